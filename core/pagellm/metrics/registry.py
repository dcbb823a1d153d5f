"""Stat logger classes by name; plugins of ``pagellm.stat_logger_plugins`` add theirs here.
Loaded in the front end only."""

from __future__ import annotations

import importlib

_LOGGERS: dict[str, str] = {}


def register_stat_logger(name: str, qualname: str) -> None:
    _LOGGERS[name] = qualname


def registered_stat_loggers() -> list[str]:
    from pagellm.plugins import load_frontend_plugins

    load_frontend_plugins()
    return sorted(_LOGGERS)


def get_stat_logger_cls(name: str) -> type:
    if name not in registered_stat_loggers():
        installed = ", ".join(registered_stat_loggers()) or "none installed"
        raise ValueError(f"Stat logger {name!r} is not installed ({installed}).")
    module_name, _, cls_name = _LOGGERS[name].partition(":")
    cls: type = getattr(importlib.import_module(module_name), cls_name)
    return cls
