"""A platform written against an older interface: `available_kv_cache_memory` lacks the
``profile_run`` argument, and `synchronize` is a plain method instead of a class method."""

import os
from typing import Any

from pagellm.platforms.cpu import CpuPlatform
from pagellm.plugins import hookimpl

pagellm_plugin_api = "1.0"


class OldSignaturePlatform(CpuPlatform):
    name = "bad_signature"

    @classmethod
    def available_kv_cache_memory(cls, config: Any, model_bytes: int) -> int:  # type: ignore[override]
        return 4 << 20

    def synchronize(self) -> None:  # type: ignore[override]
        pass


@hookimpl
def pagellm_platform() -> str | None:
    if os.environ.get("PAGELLM_BROKEN_PLATFORMS") == "1":
        return "pagellm_broken_plugin.bad_platforms:OldSignaturePlatform"
    return None
