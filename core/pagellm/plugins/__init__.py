"""The plugin system: entry-point groups loaded per process boundary, with pluggy contracts.

Each ``load_*`` function is idempotent per process and fills the registry its group feeds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagellm.plugins import groups
from pagellm.plugins.groups import GROUPS
from pagellm.plugins.hookspecs import PLUGIN_API_VERSION, hookimpl, hookspec
from pagellm.plugins.loader import (
    PluginError,
    PluginRecord,
    allowlist,
    load_group,
    register_applier,
)


@dataclass
class EndpointPlugin:
    """What an endpoint plugin's ``pagellm_endpoint`` hook returns.

    ``attach(app, engine_client)`` adds the plugin's routes to the API server's app.
    ``required_tasks``: the model tasks the routes need (e.g. {"generate"}); None means any.
    """

    attach: Any
    required_tasks: frozenset[str] | None = None
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    api_version: str = "1.1"


def _string_map(record: PluginRecord, result: Any) -> dict[str, str]:
    if not isinstance(result, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in result.items()
    ):
        raise PluginError(
            f"its hook returned {result!r}; expected a dict of name -> 'package.module:Class'"
        )
    return result


def _apply_platform(record: PluginRecord, result: Any) -> None:
    from pagellm.platforms import register_platform

    if result is None:
        record.reason = "inactive: its hardware is not present"
        return
    if not isinstance(result, str) or ":" not in result:
        raise PluginError(
            f"its hook returned {result!r}; expected 'package.module:PlatformClass' or None"
        )
    register_platform(record.name, result)


def _apply_attention(record: PluginRecord, result: Any) -> None:
    from pagellm.attention.registry import register_backend

    for name, qualname in _string_map(record, result).items():
        register_backend(name, qualname)


def _apply_quantization(record: PluginRecord, result: Any) -> None:
    from pagellm.quantization.registry import register_quantization_method

    for name, qualname in _string_map(record, result).items():
        register_quantization_method(name, qualname)


def _apply_io_processor(record: PluginRecord, result: Any) -> None:
    from pagellm.io_processors import register_io_processor

    for name, qualname in _string_map(record, result).items():
        register_io_processor(name, qualname)


def _apply_stat_logger(record: PluginRecord, result: Any) -> None:
    from pagellm.metrics.registry import register_stat_logger

    for name, qualname in _string_map(record, result).items():
        register_stat_logger(name, qualname)


def _apply_endpoint(record: PluginRecord, result: Any) -> None:
    if not isinstance(result, EndpointPlugin):
        raise PluginError(
            f"its hook returned {result!r}; expected a pagellm.plugins.EndpointPlugin"
        )


register_applier(groups.PLATFORM, _apply_platform)
register_applier(groups.ATTENTION, _apply_attention)
register_applier(groups.QUANTIZATION, _apply_quantization)
register_applier(groups.IO_PROCESSOR, _apply_io_processor)
register_applier(groups.STAT_LOGGER, _apply_stat_logger)
register_applier(groups.ENDPOINT, _apply_endpoint)


def load_general_plugins() -> list[PluginRecord]:
    return load_group(groups.GENERAL)


def load_platform_plugins() -> list[PluginRecord]:
    return load_group(groups.PLATFORM)


def load_attention_plugins() -> list[PluginRecord]:
    return load_group(groups.ATTENTION)


def load_quantization_plugins() -> list[PluginRecord]:
    return load_group(groups.QUANTIZATION)


def load_frontend_plugins() -> None:
    load_group(groups.IO_PROCESSOR)
    load_group(groups.STAT_LOGGER)


def load_endpoint_plugins(
    endpoints: list[str] | None, served_tasks: set[str] | None
) -> list[tuple[str, EndpointPlugin]]:
    """The endpoint plugins to serve: named by VLLM_PLUGINS, or (when it is unset) by the serve
    command's ``endpoints``; then only those whose required tasks the served model has.
    Pass ``served_tasks=None`` to skip the task check (listing only)."""
    import logging

    logger = logging.getLogger(__name__)
    enabled = []
    # Not cached like the other groups: the answer depends on the endpoint list and the tasks.
    for record in load_group(groups.ENDPOINT, allowed=set(endpoints or ()), force=True):
        if record.status != "loaded":
            if record.status == "skipped":
                logger.info("Endpoint plugin %r skipped: %s", record.name, record.reason)
            continue
        plugin: EndpointPlugin = record.result
        needed = plugin.required_tasks
        if served_tasks is not None and needed is not None and not (needed & served_tasks):
            record.status, record.reason = (
                "skipped",
                (
                    f"required_tasks {sorted(needed)} do not meet the served model's tasks {sorted(served_tasks)}"
                ),
            )
            logger.info("Endpoint plugin %r skipped: %s", record.name, record.reason)
            continue
        logger.info("Endpoint plugin %r enabled", record.name)
        enabled.append((record.name, plugin))
    return enabled


def plugin_report() -> dict[str, list[dict[str, str | None]]]:
    """Every discovered plugin of every group and its status in this process (loads the groups
    that were not loaded yet; endpoint plugins follow VLLM_PLUGINS alone)."""
    return {name: [r.as_dict() for r in load_group(name)] for name in GROUPS}


__all__ = [
    "GROUPS",
    "PLUGIN_API_VERSION",
    "EndpointPlugin",
    "PluginError",
    "PluginRecord",
    "allowlist",
    "hookimpl",
    "hookspec",
    "load_attention_plugins",
    "load_endpoint_plugins",
    "load_frontend_plugins",
    "load_general_plugins",
    "load_platform_plugins",
    "load_quantization_plugins",
    "plugin_report",
]
