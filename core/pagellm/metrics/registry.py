"""Stat logger classes by name; plugins of ``pagellm.stat_logger_plugins`` add theirs here.
Loaded in the front end only."""

from __future__ import annotations

from pagellm.metrics.stats import StatLoggerBase
from pagellm.plugins.groups import STAT_LOGGER
from pagellm.plugins.registry import Registry

stat_loggers: Registry[StatLoggerBase] = Registry("Stat logger", StatLoggerBase, STAT_LOGGER)
