"""Platforms and the lazily resolved ``current_platform``.

The built-in CPU platform is registered like the plugins' platforms are. On first use every
``pagellm.platform_plugins`` plugin is asked whether its hardware is present; the active ones are
registered. Exactly one active → it; several → ``PAGELLM_PLATFORM`` (the CLI's ``--device``) must
name one; none → the CPU platform. ``PAGELLM_PLATFORM=cpu`` forces the CPU platform.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from pagellm.platforms.interface import Platform

CPU = "cpu"
_PLATFORMS: dict[str, str] = {}
_current: type[Platform] | None = None
_current_name: str | None = None


def register_platform(name: str, qualname: str) -> None:
    """Register an active platform's ``"package.module:Class"`` under ``name``."""
    _PLATFORMS[name] = qualname


# The built-in CPU platform goes through the same registry as the plugins' platforms; it is the
# one chosen when no other is active.
register_platform(CPU, "pagellm.platforms.cpu:CpuPlatform")


def _load(qualname: str) -> type[Platform]:
    module_name, _, cls_name = qualname.partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        raise TypeError(f"{qualname} is not a Platform subclass.")
    return cls


def resolve_platform() -> tuple[str, type[Platform]]:
    """(registered name, class) of the platform this process should use."""
    from pagellm.plugins import load_platform_plugins

    load_platform_plugins()
    active = [name for name in _PLATFORMS if name != CPU]
    chosen = os.environ.get("PAGELLM_PLATFORM")
    if chosen:
        if chosen not in _PLATFORMS:
            raise ValueError(
                f"PAGELLM_PLATFORM={chosen!r} names no active platform; active: {sorted(_PLATFORMS)}."
            )
        return chosen, _load(_PLATFORMS[chosen])
    if len(active) > 1:
        raise ValueError(
            f"Several platforms are active ({', '.join(active)}); choose one with PAGELLM_PLATFORM "
            "(or --device)."
        )
    name = active[0] if active else CPU
    return name, _load(_PLATFORMS[name])


def get_current_platform() -> type[Platform]:
    global _current, _current_name
    if _current is None:
        _current_name, _current = resolve_platform()
    return _current


def current_platform_name() -> str:
    """The name the current platform is registered under (what PAGELLM_PLATFORM takes)."""
    get_current_platform()
    assert _current_name is not None
    return _current_name


class _LazyPlatform:
    """``current_platform`` resolves on first attribute access, so importing pagellm stays cheap
    and platform plugins are asked only in processes that need a platform."""

    def __getattr__(self, name: str) -> Any:
        return getattr(get_current_platform(), name)

    def __repr__(self) -> str:
        return f"<current_platform {get_current_platform().name}>"


current_platform: Any = _LazyPlatform()

__all__ = [
    "Platform",
    "current_platform",
    "current_platform_name",
    "get_current_platform",
    "register_platform",
]
