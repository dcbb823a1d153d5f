"""int4 weight-only quantization methods for pagellm: gptq, awq, compressed_tensors_w4a16
(see README.md)."""
