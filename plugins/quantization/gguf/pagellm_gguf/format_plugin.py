"""Registers the GGUF file reader (plugin group ``pagellm.model_formats``)."""

from pagellm.plugins import hookimpl

pagellm_plugin_api = "1.2"


@hookimpl
def pagellm_model_formats() -> dict[str, str]:
    return {"gguf": "pagellm_gguf.model_format:GGUFModelFormat"}
