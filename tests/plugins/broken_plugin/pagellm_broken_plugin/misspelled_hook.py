"""Implements a hook that does not exist (a typo of pagellm_register)."""

from pagellm.plugins import hookimpl

pagellm_plugin_api = "1.0"


@hookimpl
def pagellm_regsiter() -> None:
    pass
