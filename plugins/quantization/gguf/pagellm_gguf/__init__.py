"""pagellm-gguf: GGUF files for pagellm (reader, and on CUDA GPUs weights kept as GGUF blocks)."""
