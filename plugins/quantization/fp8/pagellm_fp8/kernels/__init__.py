"""The FP8 Triton kernels: fused activation quantization (``quant``: per token, per tensor, per
token group of 128; ``one_launch``: a per-tensor scale found and applied in one launch;
``fused_input``, its kernels in ``producer_kernels``: RMSNorm and SiLU-and-mul writing fp8; the
rounding all share in ``rounding``), the block-scaled GEMM of 128x128-block checkpoints
(``block_gemm``) and the opt-in GEMM of decode batches (``skinny_gemm``).

Every function takes and returns torch tensors on the kernels' device; the float8 format is
``torch.float8_e4m3fn`` (Triton's ``fp8e4nv``, largest finite value 448) or, on AMD CDNA3, the
``torch.float8_e4m3fnuz`` the quantization functions are asked for (``dtype``; Triton's
``fp8e4b8``, 240); scales in float32 with ``x ~= q * scale``.
"""
