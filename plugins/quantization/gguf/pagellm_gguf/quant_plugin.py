"""Registers the ``gguf`` quantization method (plugin group ``pagellm.quantization_methods``)."""

from pagellm.plugins import hookimpl

pagellm_plugin_api = "1.0"


@hookimpl
def pagellm_quantization_methods() -> dict[str, str]:
    return {"gguf": "pagellm_gguf.method:GGUFConfig"}
