"""pagellm-flash-attn: the FLASH_ATTN attention backend (paged attention on FlashAttention)."""
