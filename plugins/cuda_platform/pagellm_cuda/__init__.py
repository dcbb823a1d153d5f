"""pagellm on NVIDIA GPUs: the ``cuda`` platform plugin and its fused kernels (``pagellm_cuda.ops``).

Importing this package imports nothing heavy; the platform class lives in `pagellm_cuda.platform`
and is imported by the core only when the plugin reports a GPU.
"""
