"""Platform plugin: answers its Platform class when its "hardware" is present, else None."""

import os

from pagellm.plugins import hookimpl

pagellm_plugin_api = "1.0"


@hookimpl
def pagellm_platform() -> str | None:
    if os.environ.get("PAGELLM_DUMMY_PLATFORM") == "1":
        return "pagellm_dummy_platform.platform:DummyPlatform"
    return None
