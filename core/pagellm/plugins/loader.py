"""Discovering, validating and loading the plugins of a group, once per process.

Each discovered entry point becomes a `PluginRecord` (loaded / skipped / failed, with the reason);
`pagellm plugins` prints them. The loader fills no registry: a registry reads the records of its
group (`pagellm.plugins.registry`). A plugin that fails is logged with its traceback and does not
stop the others; with ``PAGELLM_PLUGINS_STRICT=1`` the group's failures, all of them, stop start-up.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pluggy

from pagellm.plugins.groups import ENDPOINT, GROUPS, PLATFORM, PluginGroup
from pagellm.plugins.hookspecs import PLUGIN_API_VERSION, PROJECT_NAME, EndpointPlugin

logger = logging.getLogger(__name__)


class PluginError(RuntimeError):
    """A plugin could not be loaded and strict mode is on, or a plugin broke its contract."""


@dataclass
class PluginRecord:
    group: str
    name: str
    distribution: str | None = None
    version: str | None = None
    status: str = "skipped"
    """"loaded", "skipped", "failed", "misregistered" (a class it registered does not import or
    does not fit its interface), "ignored" (its entry point is in a group pagellm does not read) or
    "not installed" (VLLM_PLUGINS names it, no installed package declares it)."""
    reason: str | None = None
    api_version: str | None = None
    """The plugin API version the plugin's module declares."""
    result: Any = field(default=None, repr=False)
    """What the plugin's hook returned (e.g. an endpoint plugin's `EndpointPlugin`)."""

    def as_dict(self) -> dict[str, str | None]:
        keys = ("name", "distribution", "version", "api_version", "status", "reason")
        return {key: getattr(self, key) for key in keys}


def allowlist() -> set[str] | None:
    """The VLLM_PLUGINS allowlist: None when unset; a set (maybe empty, matching nothing) when set."""
    raw = os.environ.get("VLLM_PLUGINS")
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def strict_mode() -> bool:
    return os.environ.get("PAGELLM_PLUGINS_STRICT", "").lower() in ("1", "true", "yes")


def discover(group: str) -> list[importlib.metadata.EntryPoint]:
    return sorted(importlib.metadata.entry_points(group=group), key=lambda ep: ep.name)


def not_installed() -> list[str]:
    """The names VLLM_PLUGINS lists that no installed plugin of any group has."""
    known = {ep.name for group in GROUPS for ep in discover(group)}
    return sorted((allowlist() or set()) - known)


def _spec(group: PluginGroup) -> inspect.Signature:
    return inspect.signature(getattr(group.spec, group.hook))


def expected_hook(group: PluginGroup) -> str:
    params = ", ".join(p for p in _spec(group).parameters if p != "self")
    return f"{group.hook}({params}) -> {_spec(group).return_annotation}"


def _returns_its_spec(group: PluginGroup, result: Any) -> bool:
    expected = _spec(group).return_annotation
    if expected == "dict[str, str]":
        return isinstance(result, dict) and all(
            isinstance(x, str) for x in (*result, *result.values())
        )
    types: dict[str, Any] = {"None": type(None), "str | None": (str, type(None))}
    types["EndpointPlugin"] = EndpointPlugin
    return isinstance(result, types[expected])


def _check_api_version(module: ModuleType) -> str:
    declared = getattr(module, "pagellm_plugin_api", None)
    if declared is None:
        raise PluginError(
            f'it declares no plugin API version: add `pagellm_plugin_api = "{PLUGIN_API_VERSION}"` to {module.__name__}'
        )
    try:
        major, minor = (int(x) for x in str(declared).split("."))
    except ValueError:
        raise PluginError(
            f"its pagellm_plugin_api {declared!r} is not of the form MAJOR.MINOR"
        ) from None
    core_major, core_minor = (int(x) for x in PLUGIN_API_VERSION.split("."))
    if major != core_major or minor > core_minor:
        raise PluginError(
            f"it targets plugin API {declared}, but this pagellm provides plugin API {PLUGIN_API_VERSION}"
        )
    return str(declared)


def _show_info_logs(module: ModuleType) -> None:
    """A plugin's own loggers show what pagellm's show (the CLI and the server set pagellm's level;
    a plugin package is not below the ``pagellm`` logger)."""
    level = logging.getLogger(PROJECT_NAME).level
    plugin_logger = logging.getLogger(module.__name__.partition(".")[0])
    if level != logging.NOTSET and plugin_logger.level == logging.NOTSET:
        plugin_logger.setLevel(level)


def _inactive_reason(pm: pluggy.PluginManager, name: str, who: str) -> str:
    """What an inactive platform plugin says of itself (API 1.3), or the generic reason."""
    module = pm.get_plugin(name)
    others = [p for p in pm.get_plugins() if p is not module]
    try:
        said = pm.subset_hook_caller("pagellm_platform_inactive_reason", remove_plugins=others)()
    except Exception as exc:
        logger.warning("%s could not say why it is inactive: %s", who, exc, exc_info=True)
        said = []
    if said and isinstance(said[0], str) and said[0].strip():
        return said[0].strip()
    return "its hardware is not present"


def _load_one(
    ep: importlib.metadata.EntryPoint,
    group: PluginGroup,
    pm: pluggy.PluginManager,
    record: PluginRecord,
) -> None:
    """Import the plugin's module, register it with the group's plugin manager (pluggy checks
    hook names and arguments against the specification) and call its hook."""
    who = f"Plugin {ep.name!r} ({record.distribution}) of group {group.name}"
    expected = f"expected {expected_hook(group)}"
    try:
        if ep.attr:
            raise PluginError(
                f"its entry point {ep.value!r} names an attribute (the vLLM style: a function to "
                f"call); pagellm's entry points name a module of @hookimpl functions: set the value "
                f"to {ep.module!r} and implement `@hookimpl def {group.hook}()` there"
            )
        module = ep.load()
        record.api_version = api_version = _check_api_version(module)
        _show_info_logs(module)
        try:
            pm.register(module, name=ep.name)
            pm.check_pending()
        except pluggy.PluginValidationError as exc:
            pm.unregister(name=ep.name)
            raise PluginError(f"{exc}; {expected}".replace("\n", "; ")) from None
        if not pm.get_hookcallers(module):
            raise PluginError(f"it implements no hook of {group.name}; {expected}")
        others = [p for p in pm.get_plugins() if p is not module]
        results = pm.subset_hook_caller(group.hook, remove_plugins=others)()
        record.result = results[0] if results else None
        if not _returns_its_spec(group, record.result):
            raise PluginError(f"its hook returned {record.result!r}; {expected}")
        if isinstance(record.result, EndpointPlugin):
            record.result.api_version = api_version
    except Exception as exc:
        record.status, record.reason = "failed", f"{type(exc).__name__}: {exc}"
        logger.error("%s failed to load: %s", who, record.reason, exc_info=True)
        return
    record.status = "loaded"
    if record.result is None and group.name == PLATFORM:
        record.reason = f"inactive: {_inactive_reason(pm, ep.name, who)}"
    level = logging.INFO if group.name in (PLATFORM, ENDPOINT) else logging.DEBUG
    logger.log(level, "%s loaded%s", who, f" ({record.reason})" if record.reason else "")


def _skip_reason(
    record: PluginRecord, group: PluginGroup, names: set[str] | None, allowed: set[str] | None
) -> str | None:
    if record.distribution == PROJECT_NAME:
        return None  # the core's own plugins (its scheduling policies) are not for VLLM_PLUGINS
    if names is not None:
        return None if record.name in names else "not in the VLLM_PLUGINS allowlist"
    if not group.default_allow and (allowed is None or record.name not in allowed):
        return "endpoint plugins are off unless named (VLLM_PLUGINS or the serve command's --endpoints)"
    if allowed is not None and record.name not in allowed:
        return "not enabled"
    return None


_records: dict[str, list[PluginRecord]] = {}


def load_group(
    group_name: str, allowed: set[str] | None = None, force: bool = False
) -> list[PluginRecord]:
    """Load the plugins of a group once per process (``allowed`` overrides the default allowlist
    when VLLM_PLUGINS is unset: the serve command's endpoint list). One pluggy plugin manager
    holds the group's plugins."""
    if group_name in _records and not force:
        return _records[group_name]
    if not _records and not_installed():
        logger.warning(
            "VLLM_PLUGINS names plugins that are not installed: %s", ", ".join(not_installed())
        )
    group = GROUPS[group_name]
    names = allowlist()
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(group.spec)
    records = []
    for ep in discover(group_name):
        dist = getattr(ep, "dist", None)
        record = PluginRecord(group_name, ep.name, dist and dist.name, dist and dist.version)
        records.append(record)
        record.reason = _skip_reason(record, group, names, allowed)
        if record.reason is None:
            _load_one(ep, group, pm, record)
    _records[group_name] = records
    failed = [r for r in records if r.status == "failed"]
    if failed and strict_mode():
        raise PluginError(
            f"{len(failed)} plugin(s) of group {group_name} failed to load "
            "(PAGELLM_PLUGINS_STRICT=1): "
            + "; ".join(f"{r.name!r} ({r.distribution}): {r.reason}" for r in failed)
        )
    return records


def loaded_records() -> dict[str, list[PluginRecord]]:
    return dict(_records)
