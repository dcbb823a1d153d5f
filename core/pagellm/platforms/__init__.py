"""Platforms and the lazily resolved ``current_platform``.

The built-in CPU platform is registered like the plugins' platforms are. On first use every
``pagellm.platform_plugins`` plugin is asked whether its hardware is present; the active ones are
registered under their plugin names. Exactly one active → it; several → ``PAGELLM_PLATFORM`` (the
CLI's ``--device``) must name one; none → the CPU platform. ``PAGELLM_PLATFORM=cpu`` forces the CPU
platform. The chosen class is checked against the `Platform` interface.
"""

from __future__ import annotations

import os
from typing import Any

from pagellm.platforms.interface import Platform
from pagellm.plugins.groups import PLATFORM
from pagellm.plugins.registry import Registry

CPU = "cpu"
platforms: Registry[Platform] = Registry("Platform", Platform, PLATFORM)
# The built-in CPU platform goes through the same registry as the plugins' platforms; it is the
# one chosen when no other is active.
platforms.register(CPU, "pagellm.platforms.cpu:CpuPlatform")
_current: tuple[str, type[Platform]] | None = None


def resolve_platform() -> tuple[str, type[Platform]]:
    """(registered name, class) of the platform this process should use."""
    registered = platforms.names()
    active = [name for name in registered if name != CPU]
    chosen = os.environ.get("PAGELLM_PLATFORM")
    if chosen:
        if chosen not in registered:
            raise ValueError(
                f"PAGELLM_PLATFORM={chosen!r} names no active platform; active: {sorted(registered)}."
            )
        return chosen, platforms.get(chosen)
    if len(active) > 1:
        raise ValueError(
            f"Several platforms are active ({', '.join(active)}); choose one with PAGELLM_PLATFORM "
            "(or --device)."
        )
    name = active[0] if active else CPU
    return name, platforms.get(name)


def _resolved() -> tuple[str, type[Platform]]:
    global _current
    if _current is None:
        _current = resolve_platform()
    return _current


def current_platform_name() -> str:
    """The name the current platform is registered under (what PAGELLM_PLATFORM takes)."""
    return _resolved()[0]


class _LazyPlatform:
    """``current_platform`` resolves on first attribute access, so importing pagellm stays cheap
    and platform plugins are asked only in processes that need a platform."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_resolved()[1], name)

    def __repr__(self) -> str:
        return f"<current_platform {_resolved()[1].name}>"


current_platform: Any = _LazyPlatform()
