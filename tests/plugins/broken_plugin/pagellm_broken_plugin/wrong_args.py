"""Implements pagellm_register with an argument the specification does not have."""

from pagellm.plugins import hookimpl

pagellm_plugin_api = "1.0"


@hookimpl
def pagellm_register(registry) -> None:  # type: ignore[no-untyped-def]
    pass
