"""``--pagellm-fake-hardware MODULE:NAME``: a platform checked where its hardware is absent.

``MODULE:NAME`` names a callable of the platform's plugin package that returns a context manager;
entering it fakes the facts the plugin's detection reads (a library's answers, torch's build, ...)
and yields a one-line description of them. The kit enters it before anything asks the platform
plugins, so the platform resolves active, and leaves it when the run ends. What it fakes must be
only what detection and the platform's decisions read: a case that would run on the device skips
(`targets.PlatformTarget.device_unavailable`), since there is no device behind the facts.
"""

from __future__ import annotations

import contextlib
import importlib

import pytest


def enter_faked_hardware(
    config: pytest.Config, spec: str | None, platform: str | None
) -> str | None:
    """The faked facts' description, once they are in place (None without ``spec``); they are
    taken away when pytest unconfigures."""
    if not spec:
        return None
    if not platform:
        raise pytest.UsageError(
            f"--pagellm-fake-hardware {spec} fakes a platform's hardware: name the platform with "
            "--pagellm-platform"
        )
    module_name, _, name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), name) if name else None
    except (ImportError, AttributeError) as exc:
        raise pytest.UsageError(
            f"--pagellm-fake-hardware {spec}: {type(exc).__name__}: {exc}"
        ) from None
    if not callable(factory):
        raise pytest.UsageError(
            f"--pagellm-fake-hardware {spec} names no callable (MODULE:NAME, e.g. "
            "pagellm_rocm.fake_hardware:gfx942)"
        )
    stack = contextlib.ExitStack()
    description = stack.enter_context(factory())
    config.add_cleanup(stack.close)
    if not isinstance(description, str) or not description:
        stack.close()
        raise pytest.UsageError(
            f"--pagellm-fake-hardware {spec}: its context manager yielded {description!r}, not a "
            "description of the facts it fakes"
        )
    return description
