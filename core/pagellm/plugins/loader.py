"""Discovering, validating and loading plugins, once per process and group.

Each discovered entry point becomes a `PluginRecord` (loaded / skipped / failed, with the reason);
`pagellm plugins` prints them. A plugin that fails is logged with its traceback and does not stop
the others, unless ``PAGELLM_PLUGINS_STRICT=1``.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pluggy

from pagellm.plugins import groups as g
from pagellm.plugins.hookspecs import PLUGIN_API_VERSION, PROJECT_NAME

logger = logging.getLogger(__name__)


class PluginError(RuntimeError):
    """A plugin could not be loaded and strict mode is on, or a plugin broke its contract."""


@dataclass
class PluginRecord:
    group: str
    name: str
    distribution: str | None
    version: str | None
    status: str = "skipped"
    """"loaded", "skipped" or "failed"."""
    reason: str | None = None
    result: Any = field(default=None, repr=False)
    """What the plugin's hook returned (e.g. an endpoint plugin's `EndpointPlugin`)."""

    def as_dict(self) -> dict[str, str | None]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "status": self.status,
            "reason": self.reason,
        }


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


def _spec_signatures(spec: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(fn)
        for name, fn in vars(spec).items()
        if callable(fn) and name.startswith(f"{PROJECT_NAME}_")
    }


def _describe(name: str, sig: inspect.Signature) -> str:
    params = [p for p in sig.parameters.values() if p.name != "self"]
    return f"{name}({', '.join(p.name for p in params)}) -> {sig.return_annotation}"


def _check_api_version(module: ModuleType) -> None:
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


def _validate_hooks(module: ModuleType, group: g.PluginGroup) -> list[str]:
    """Check every @hookimpl of the module against the group's specs; return the hook names."""
    specs = _spec_signatures(group.spec)
    expected = "; ".join(_describe(n, s) for n, s in specs.items())
    marker = f"{PROJECT_NAME}_impl"
    hooks = []
    for attr, fn in vars(module).items():
        if not callable(fn) or not hasattr(fn, marker):
            continue
        if attr not in specs:
            raise PluginError(f"hook {attr!r} is not a hook of {group.name}; expected {expected}")
        spec_args = {p for p in specs[attr].parameters if p != "self"}
        impl_args = set(inspect.signature(fn).parameters)
        if not impl_args <= spec_args:
            raise PluginError(
                f"hook {attr!r} takes ({', '.join(sorted(impl_args))}) but the specification is "
                f"{_describe(attr, specs[attr])}"
            )
        hooks.append(attr)
    if not hooks:
        raise PluginError(f"it implements no hook of {group.name}; expected {expected}")
    return hooks


def _call_hook(module: ModuleType, name: str, group: g.PluginGroup, hook: str) -> Any:
    """Register the module with a pluggy manager for its group (pluggy re-checks the contract)
    and call the hook; returns the plugin's result."""
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(group.spec)
    pm.register(module, name=name)
    pm.check_pending()
    results = getattr(pm.hook, hook)()
    return results[0] if results else None


# What to do with each group's hook result: fill the matching registry.
Applier = Callable[[PluginRecord, Any], None]
_APPLIERS: dict[str, Applier] = {}
_records: dict[str, list[PluginRecord]] = {}


def register_applier(group: str, applier: Applier) -> None:
    _APPLIERS[group] = applier


def _dist(ep: importlib.metadata.EntryPoint) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    return (dist.metadata["Name"], dist.version) if dist is not None else (None, None)


def _load_one(
    ep: importlib.metadata.EntryPoint, group: g.PluginGroup, record: PluginRecord
) -> None:
    try:
        module = ep.load()
        if not isinstance(module, ModuleType):
            raise PluginError(
                f"entry point {ep.value!r} must name a module of hook implementations"
            )
        _check_api_version(module)
        hooks = _validate_hooks(module, group)
        record.result = _call_hook(module, ep.name, group, hooks[0])
        applier = _APPLIERS.get(group.name)
        if applier is not None:
            applier(record, record.result)
        record.status = "loaded"
    except Exception as exc:
        record.status = "failed"
        record.reason = f"{type(exc).__name__}: {exc}"
        logger.error(
            "Plugin %r (%s) of group %s failed to load: %s\n%s",
            ep.name,
            record.distribution,
            group.name,
            record.reason,
            traceback.format_exc(),
        )
        if strict_mode():
            raise PluginError(
                f"plugin {ep.name!r} ({record.distribution}) of group {group.name} failed to load "
                f"(PAGELLM_PLUGINS_STRICT=1): {record.reason}"
            ) from exc


def load_group(
    group_name: str, allowed: set[str] | None = None, force: bool = False
) -> list[PluginRecord]:
    """Load the plugins of a group once per process (``allowed`` overrides the default allowlist
    when VLLM_PLUGINS is unset: the serve command's endpoint list)."""
    if group_name in _records and not force:
        return _records[group_name]
    group = g.GROUPS[group_name]
    names = allowlist()
    records = []
    for ep in discover(group_name):
        dist, version = _dist(ep)
        record = PluginRecord(group_name, ep.name, dist, version)
        records.append(record)
        if names is not None and ep.name not in names:
            record.reason = "not in the VLLM_PLUGINS allowlist"
        elif (
            names is None
            and not group.default_allow
            and (allowed is None or ep.name not in allowed)
        ):
            record.reason = "endpoint plugins are off unless named (VLLM_PLUGINS or the serve command's --endpoints)"
        elif names is None and allowed is not None and ep.name not in allowed:
            record.reason = "not enabled"
        else:
            _load_one(ep, group, record)
            level = logging.INFO if group_name in (g.PLATFORM, g.ENDPOINT) else logging.DEBUG
            if record.status == "loaded":
                note = f" ({record.reason})" if record.reason else ""
                logger.log(
                    level, "Loaded plugin %r (%s) of group %s%s", ep.name, dist, group_name, note
                )
    if names:
        known = {ep.name for grp in g.GROUPS for ep in discover(grp)}
        unknown = names - known
        if unknown:
            logger.warning(
                "VLLM_PLUGINS names plugins that are not installed: %s", ", ".join(sorted(unknown))
            )
    _records[group_name] = records
    return records


def loaded_records() -> dict[str, list[PluginRecord]]:
    return dict(_records)
