"""What `pagellm plugins` shows: every plugin of every group and its status in this process, the
classes each registered checked by importing them, the entry points of groups pagellm does not
read, and the names VLLM_PLUGINS lists that no installed package has."""

from __future__ import annotations

import difflib
import importlib.metadata

from pagellm.attention.registry import attention_backends
from pagellm.io_processors import io_processors
from pagellm.metrics.registry import stat_loggers
from pagellm.models.registry import models
from pagellm.platforms import platforms
from pagellm.plugins.groups import GROUPS
from pagellm.plugins.loader import (
    PluginError,
    PluginRecord,
    load_group,
    loaded_records,
    not_installed,
    strict_mode,
)
from pagellm.quantization.registry import quantization_methods
from pagellm.scheduler.policy import scheduling_policies

NOT_INSTALLED = "VLLM_PLUGINS"
"""The report's section for names the allowlist lists and no installed plugin has."""
REGISTRIES = (
    platforms,
    attention_backends,
    models,
    quantization_methods,
    scheduling_policies,
    io_processors,
    stat_loggers,
)


def ignored_entry_points() -> list[PluginRecord]:
    """Entry points in a group pagellm does not read but that looks meant for it: a vLLM group
    (``vllm.general_plugins``) or a misspelled one (``pagellm.platform_plugin``)."""
    records = []
    for dist in importlib.metadata.distributions():
        for ep in dist.entry_points:
            meant = difflib.get_close_matches(ep.group.replace("vllm.", "pagellm.", 1), GROUPS, n=1)
            if ep.group in GROUPS or not (meant or ep.group.startswith(("pagellm", "vllm."))):
                continue
            fix = f"move it to {meant[0]!r}" if meant else f"pagellm reads {', '.join(GROUPS)}"
            records.append(
                PluginRecord(
                    ep.group,
                    ep.name,
                    distribution=dist.name,
                    version=dist.version,
                    status="ignored",
                    reason=f"unknown group {ep.group!r}: {fix}",
                )
            )
    return records


def plugin_report() -> dict[str, list[dict[str, str | None]]]:
    """Loads the groups not loaded yet (endpoint plugins follow VLLM_PLUGINS alone). In strict
    mode, every failed and every misregistered plugin of every group raises one `PluginError`."""
    failures = []
    for group in GROUPS:
        try:
            load_group(group)
        except PluginError as exc:
            failures.append(str(exc))
    for registry in REGISTRIES:
        registry.check()
    records = loaded_records()
    failures += [
        f"plugin {r.name!r} ({r.distribution}) of group {r.group} is misregistered: {r.reason}"
        for group in GROUPS
        for r in records[group]
        if r.status == "misregistered"
    ]
    if failures and strict_mode():
        raise PluginError("\n".join(failures))
    report = {group: [r.as_dict() for r in records[group]] for group in GROUPS}
    for record in ignored_entry_points():
        report.setdefault(record.group, []).append(record.as_dict())
    reason = "VLLM_PLUGINS names it, but no installed package declares a plugin of that name"
    missing = [
        PluginRecord(NOT_INSTALLED, n, status="not installed", reason=reason)
        for n in not_installed()
    ]
    if missing:
        report[NOT_INSTALLED] = [r.as_dict() for r in missing]
    return report


def format_report(report: dict[str, list[dict[str, str | None]]]) -> str:
    """One table per group, for people."""
    lines = []
    for group, records in report.items():
        where = GROUPS[group].loaded_in if group in GROUPS else "not a pagellm group"
        lines.append(
            f"{group}  ({'names matching no plugin' if group == NOT_INSTALLED else where})"
        )
        if not records:
            lines.append("  (none installed)")
        for r in records:
            dist = f"{r['distribution']} {r['version']}" if r["distribution"] else "?"
            reason = f": {r['reason']}" if r["reason"] else ""
            lines.append(f"  {r['name']:<24} {dist:<36} {r['status']}{reason}")
    return "\n".join(lines)
