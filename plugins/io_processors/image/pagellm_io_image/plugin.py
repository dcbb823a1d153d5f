"""The ``image`` IO processor's registration (``pagellm.io_processor_plugins``)."""

from __future__ import annotations

from pagellm.plugins import hookimpl

pagellm_plugin_api = "1.2"


@hookimpl
def pagellm_io_processors() -> dict[str, str]:
    return {"image": "pagellm_io_image.processor:ImageProcessor"}
