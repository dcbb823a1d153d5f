"""Platforms and the lazily resolved ``current_platform``.

Platforms are registered by name with the qualified name of their class; the built-in CPU
platform is registered the same way. Resolution happens on first use: every registered
non-CPU platform whose hardware is present is a candidate; exactly one → it; several →
``PAGELLM_PLATFORM`` must name one; none → the CPU platform.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from pagellm.platforms.interface import Platform

_PLATFORMS: dict[str, str] = {"cpu": "pagellm.platforms.cpu:CpuPlatform"}
_current: type[Platform] | None = None


def register_platform(name: str, qualname: str) -> None:
    _PLATFORMS[name] = qualname


def _load(qualname: str) -> type[Platform]:
    module_name, _, cls_name = qualname.partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        raise TypeError(f"{qualname} is not a Platform subclass.")
    return cls


def resolve_platform() -> type[Platform]:
    chosen = os.environ.get("PAGELLM_PLATFORM")
    if chosen:
        if chosen not in _PLATFORMS:
            raise ValueError(
                f"PAGELLM_PLATFORM={chosen!r} names no installed platform; installed: {sorted(_PLATFORMS)}."
            )
        return _load(_PLATFORMS[chosen])
    active = [name for name, qn in _PLATFORMS.items() if name != "cpu" and _load(qn).is_available()]
    if len(active) > 1:
        raise ValueError(
            f"Several platforms are active ({', '.join(active)}); choose one with PAGELLM_PLATFORM."
        )
    return _load(_PLATFORMS[active[0] if active else "cpu"])


def get_current_platform() -> type[Platform]:
    global _current
    if _current is None:
        _current = resolve_platform()
    return _current


class _LazyPlatform:
    """``current_platform`` resolves on first attribute access, so importing pagellm stays cheap
    and plugins registered before that first access are taken into account."""

    def __getattr__(self, name: str) -> Any:
        return getattr(get_current_platform(), name)

    def __repr__(self) -> str:
        return f"<current_platform {get_current_platform().name}>"


current_platform: Any = _LazyPlatform()

__all__ = ["Platform", "current_platform", "get_current_platform", "register_platform"]
