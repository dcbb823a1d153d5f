# pagellm_doc_example/platform_plugin.py
"""The platform hook. It runs in every process that reads ``current_platform``, so it only looks
for its hardware (here: an environment variable) and names its class without importing it."""

import os

from pagellm.plugins import hookimpl

pagellm_plugin_api = "1.1"
# What the hook answers where the hardware is; the conformance kit reads it where it is not.
pagellm_platform_class = "pagellm_doc_example.platform:PlainCpuPlatform"


@hookimpl
def pagellm_platform() -> str | None:
    if os.environ.get("PAGELLM_PLAIN_CPU") == "1":
        return pagellm_platform_class
    return None
