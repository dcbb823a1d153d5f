"""Attention-backend plugin: names the backend; its module is imported only when it is chosen."""

from pagellm.plugins import hookimpl

pagellm_plugin_api = "1.0"


@hookimpl
def pagellm_attention_backends() -> dict[str, str]:
    return {"FLASH_ATTN": "pagellm_flash_attn.backend:FlashAttnBackend"}
