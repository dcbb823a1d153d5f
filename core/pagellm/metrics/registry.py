"""Stat logger classes by name; plugins of ``pagellm.stat_logger_plugins`` add theirs here.
Loaded in the front end only."""

from __future__ import annotations

from pagellm.metrics.stats import StatLoggerBase
from pagellm.plugins.class_registry import ClassRegistry


def _load_plugins() -> None:
    from pagellm.plugins import load_frontend_plugins

    load_frontend_plugins()


_REGISTRY: ClassRegistry[StatLoggerBase] = ClassRegistry(
    "Stat logger", StatLoggerBase, _load_plugins
)
register_stat_logger = _REGISTRY.register
registered_stat_loggers = _REGISTRY.names
get_stat_logger_cls = _REGISTRY.get
