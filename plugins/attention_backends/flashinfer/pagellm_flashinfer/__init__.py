"""pagellm-flashinfer: the FLASHINFER attention backend (paged attention with FlashInfer's kernels)."""
