"""Attention-backend plugin: names its backends; their classes are imported only when chosen."""

from pagellm.plugins import hookimpl

pagellm_plugin_api = "1.0"


@hookimpl
def pagellm_attention_backends() -> dict[str, str]:
    return {"DUMMY_ATTN": "pagellm_dummy_attention.backend:DummyAttentionBackend"}
