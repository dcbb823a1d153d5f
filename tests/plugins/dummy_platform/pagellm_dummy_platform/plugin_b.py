"""A second platform of the same package, active when PAGELLM_DUMMY_PLATFORM_B=1."""

import os

from pagellm.plugins import hookimpl

pagellm_plugin_api = "1.0"
pagellm_platform_class = "pagellm_dummy_platform.platform:DummyPlatformB"


@hookimpl
def pagellm_platform() -> str | None:
    if os.environ.get("PAGELLM_DUMMY_PLATFORM_B") == "1":
        return pagellm_platform_class
    return None
