"""The ``pagellm.quantization_methods`` hook: the three method names and their config classes."""

from __future__ import annotations

from pagellm.plugins import hookimpl

pagellm_plugin_api = "1.1"


@hookimpl
def pagellm_quantization_methods() -> dict[str, str]:
    return {
        "gptq": "pagellm_int4.config:GptqConfig",
        "awq": "pagellm_int4.config:AwqConfig",
        "compressed_tensors_w4a16": "pagellm_int4.config:CompressedTensorsW4A16Config",
    }
