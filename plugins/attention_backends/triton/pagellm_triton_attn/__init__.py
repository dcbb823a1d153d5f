"""pagellm-triton-attn: the TRITON_ATTN attention backend (paged attention in Triton)."""
