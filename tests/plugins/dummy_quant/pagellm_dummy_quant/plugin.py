"""Quantization plugin: names its methods (what --quantization takes)."""

from pagellm.plugins import hookimpl

pagellm_plugin_api = "1.0"


@hookimpl
def pagellm_quantization_methods() -> dict[str, str]:
    return {"dummy_int8": "pagellm_dummy_quant.method:Int8WeightOnlyConfig"}
