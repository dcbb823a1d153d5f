"""Targets a plugin API major version this pagellm does not provide."""

from pagellm.plugins import hookimpl

pagellm_plugin_api = "2.0"


@hookimpl
def pagellm_register() -> None:
    pass
