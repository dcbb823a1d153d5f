"""pagellm-int4's Triton kernels (``w4a16``): the fused W4A16 GEMM of decode-sized batches and
the dequantization of a whole weight for the cuBLAS path, both reading the kernel layout of
``pagellm_int4.kernel_layout``."""
