"""pagellm-int4's CUDA kernels (``w4a16_mma.cu``), compiled on the machine by nvcc into a cubin
(`build`), loaded and launched through the CUDA driver API (`driver`), run by `kernels`."""
