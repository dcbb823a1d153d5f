"""The ``embeddings`` IO processor, registered in ``pagellm.io_processor_plugins``."""

from __future__ import annotations

from pagellm.plugins import hookimpl

pagellm_plugin_api = "1.3"


@hookimpl
def pagellm_io_processors() -> dict[str, str]:
    return {"embeddings": "pagellm_io_embeddings.processor:EmbeddingsProcessor"}
