"""Registers the reference backend under a name that is not the backend's own."""

from pagellm.plugins import hookimpl

pagellm_plugin_api = "1.0"


@hookimpl
def pagellm_attention_backends() -> dict[str, str]:
    return {"SDPA_ALIAS": "pagellm.attention.backends.torch_sdpa:TorchSDPABackend"}
