"""A platform plugin whose hook names a class that does not exist."""

import os

from pagellm.plugins import hookimpl

pagellm_plugin_api = "1.0"


@hookimpl
def pagellm_platform() -> str | None:
    if os.environ.get("PAGELLM_BROKEN_PLATFORMS") == "1":
        return "pagellm_broken_plugin.no_such_module.Platform"
    return None
