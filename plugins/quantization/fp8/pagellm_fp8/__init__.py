"""FP8 (float8_e4m3fn) quantization methods for pagellm: fp8, fp8_per_tensor, fp8_per_channel,
fp8_per_block (see README.md)."""
