"""pagellm-fp8: FP8 (float8_e4m3fn) weight, activation and KV-cache quantization for pagellm."""
