"""Stat-logger plugin (front end only)."""

from pagellm.plugins import hookimpl

pagellm_plugin_api = "1.0"


@hookimpl
def pagellm_stat_loggers() -> dict[str, str]:
    return {"collecting": "pagellm_dummy_frontend.processors:CollectingStatLogger"}
