# pagellm_doc_example/attention_plugin.py
"""The attention-backend hook: the backend's name and class path. The class is imported only
where PLAIN_TORCH is a candidate (selection) or the chosen backend (the workers)."""

from pagellm.plugins import hookimpl

pagellm_plugin_api = "1.1"


@hookimpl
def pagellm_attention_backends() -> dict[str, str]:
    return {"PLAIN_TORCH": "pagellm_doc_example.attention:PlainTorchBackend"}
