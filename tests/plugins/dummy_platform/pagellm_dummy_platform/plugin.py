"""Platform plugin: answers its Platform class when its "hardware" is present, else None, and
says so through its own logger."""

import logging
import os

from pagellm.plugins import hookimpl

pagellm_plugin_api = "1.0"
pagellm_platform_class = "pagellm_dummy_platform.platform:DummyPlatform"
logger = logging.getLogger(__name__)


@hookimpl
def pagellm_platform() -> str | None:
    if os.environ.get("PAGELLM_DUMMY_PLATFORM") == "1":
        logger.info("dummy hardware found")
        return pagellm_platform_class
    return None
