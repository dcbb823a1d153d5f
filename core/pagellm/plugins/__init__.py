"""The plugin system: entry-point groups loaded per process boundary, with pluggy contracts.

The loader (`loader.py`) loads a group and returns its records; each registry
(`pagellm.plugins.registry.Registry`) loads its group on its first lookup. The ``load_*`` functions
here load the groups that have no registry to do it (general plugins: side effects; endpoints).
"""

from __future__ import annotations

import logging

from pagellm.plugins import groups
from pagellm.plugins.hookspecs import EndpointPlugin, hookimpl
from pagellm.plugins.loader import PluginError, PluginRecord, allowlist, load_group

logger = logging.getLogger(__name__)


def load_general_plugins() -> list[PluginRecord]:
    return load_group(groups.GENERAL)


def load_frontend_plugins() -> None:
    load_group(groups.IO_PROCESSOR)
    load_group(groups.STAT_LOGGER)


def load_endpoint_plugins(
    endpoints: list[str] | None,
    served_tasks: set[str] | None,
    skipped: dict[str, str] | None = None,
) -> list[tuple[str, EndpointPlugin]]:
    """The endpoint plugins to serve: named by VLLM_PLUGINS, or (when it is unset) by the serve
    command's ``endpoints``; then only those whose required tasks the served model has.
    Pass ``served_tasks=None`` to skip the task check (listing only). Each plugin's
    ``api_version`` says which ``attach`` signature it was written for. ``skipped``, when
    given, gets each plugin left out for its tasks, with the reason."""
    enabled = []
    # Not cached like the other groups: the answer depends on the endpoint list and the tasks.
    for record in load_group(groups.ENDPOINT, allowed=set(endpoints or ()), force=True):
        needed = record.result.required_tasks if record.status == "loaded" else None
        if served_tasks is not None and needed is not None and not (needed & served_tasks):
            record.status = "skipped"
            record.reason = f"required_tasks {sorted(needed)} do not meet the served model's tasks {sorted(served_tasks)}"
            if skipped is not None:
                skipped[record.name] = record.reason
        if record.status == "skipped":
            logger.info("Endpoint plugin %r skipped: %s", record.name, record.reason)
        elif record.status == "loaded":
            logger.info("Endpoint plugin %r enabled", record.name)
            enabled.append((record.name, record.result))
    return enabled


__all__ = [
    "EndpointPlugin",
    "PluginError",
    "allowlist",
    "hookimpl",
    "load_endpoint_plugins",
    "load_frontend_plugins",
    "load_general_plugins",
]
