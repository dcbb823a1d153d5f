"""The ``pagellm.quantization_methods`` hook: the four method names and their config classes."""

from __future__ import annotations

from pagellm.plugins import hookimpl

pagellm_plugin_api = "1.1"


@hookimpl
def pagellm_quantization_methods() -> dict[str, str]:
    return {
        "fp8": "pagellm_fp8.config:Fp8Config",
        "fp8_per_tensor": "pagellm_fp8.config:Fp8PerTensorConfig",
        "fp8_per_channel": "pagellm_fp8.config:Fp8PerChannelConfig",
        "fp8_per_block": "pagellm_fp8.config:Fp8PerBlockConfig",
    }
