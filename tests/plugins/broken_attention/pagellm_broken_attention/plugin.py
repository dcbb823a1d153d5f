"""Attention-backend plugin: registers BROKEN_ATTN, which loads and selects like any backend."""

from pagellm.plugins import hookimpl

pagellm_plugin_api = "1.2"


@hookimpl
def pagellm_attention_backends() -> dict[str, str]:
    return {"BROKEN_ATTN": "pagellm_broken_attention.backend:BrokenAttentionBackend"}
