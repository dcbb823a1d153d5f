"""IO processors (multimodal input/output) by name; plugins of ``pagellm.io_processor_plugins`` add
theirs here. Loaded in the front end only."""

from __future__ import annotations

import importlib

_PROCESSORS: dict[str, str] = {}


def register_io_processor(name: str, qualname: str) -> None:
    _PROCESSORS[name] = qualname


def registered_io_processors() -> list[str]:
    from pagellm.plugins import load_frontend_plugins

    load_frontend_plugins()
    return sorted(_PROCESSORS)


def get_io_processor_cls(name: str) -> type:
    if name not in registered_io_processors():
        installed = ", ".join(registered_io_processors()) or "none installed"
        raise ValueError(f"IO processor {name!r} is not installed ({installed}).")
    module_name, _, cls_name = _PROCESSORS[name].partition(":")
    cls: type = getattr(importlib.import_module(module_name), cls_name)
    return cls
