"""IO-processor plugin (front end only)."""

from pagellm.plugins import hookimpl

pagellm_plugin_api = "1.0"


@hookimpl
def pagellm_io_processors() -> dict[str, str]:
    return {"upper_text": "pagellm_dummy_frontend.processors:UpperTextProcessor"}
