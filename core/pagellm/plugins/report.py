"""What `pagellm plugins` shows: every plugin of every group and its status in this process, the
classes each registered checked by importing them, the entry points of groups pagellm does not
read, and the names VLLM_PLUGINS lists that no installed package has."""

from __future__ import annotations

import difflib
import importlib.metadata

from pagellm.attention.registry import attention_backends
from pagellm.io_processors import io_processors
from pagellm.metrics.registry import stat_loggers
from pagellm.platforms import platforms
from pagellm.plugins import loader
from pagellm.plugins.groups import GROUPS
from pagellm.plugins.loader import PluginError, PluginRecord
from pagellm.quantization.registry import quantization_methods
from pagellm.scheduler.policy import scheduling_policies

NOT_INSTALLED = "VLLM_PLUGINS"  # the section of names it lists that no installed plugin has
REGISTRIES = (
    platforms,
    attention_backends,
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
            # Other projects' groups (console_scripts, pandas_plotting_backends...) are not ours.
            if ep.group in GROUPS or not ep.group.startswith(("pagellm", "vllm.")):
                continue
            meant = difflib.get_close_matches(ep.group.replace("vllm.", "pagellm.", 1), GROUPS, n=1)
            fix = f"move it to {meant[0]!r}" if meant else f"pagellm reads {', '.join(GROUPS)}"
            reason = f"unknown group {ep.group!r}: {fix}"
            records.append(
                PluginRecord(ep.group, ep.name, dist.name, dist.version, "ignored", reason)
            )
    return records


def plugin_report() -> dict[str, list[dict[str, str | None]]]:
    """Loads the groups not loaded yet (endpoint plugins follow VLLM_PLUGINS alone). In strict
    mode, every failed and every misregistered plugin of every group raises one `PluginError`."""
    failures = []
    for group in GROUPS:
        try:
            loader.load_group(group)
        except PluginError as exc:
            failures.append(str(exc))
    for registry in REGISTRIES:
        registry.check()
    records = {group: loader.loaded_records()[group] for group in GROUPS}
    failures += [
        f"plugin {r.name!r} ({r.distribution}) of group {r.group} is misregistered: {r.reason}"
        for group_records in records.values()
        for r in group_records
        if r.status == "misregistered"
    ]
    if failures and loader.strict_mode():
        raise PluginError("\n".join(failures))
    for record in ignored_entry_points():
        records.setdefault(record.group, []).append(record)
    reason = "VLLM_PLUGINS names it, but no installed package declares a plugin of that name"
    for name in loader.not_installed():
        records.setdefault(NOT_INSTALLED, []).append(
            PluginRecord(NOT_INSTALLED, name, status="not installed", reason=reason)
        )
    return {group: [r.as_dict() for r in group_records] for group, group_records in records.items()}


def format_report(report: dict[str, list[dict[str, str | None]]]) -> str:
    """One table per group, for people."""
    lines = []
    for group, records in report.items():
        where = GROUPS[group].loaded_in if group in GROUPS else "not a pagellm group"
        lines.append(f"{group}  ({'names no plugin has' if group == NOT_INSTALLED else where})")
        if not records:
            lines.append("  (none installed)")
        for r in records:
            dist = f"{r['distribution']} {r['version']}" if r["distribution"] else "?"
            reason = f": {r['reason']}" if r["reason"] else ""
            lines.append(f"  {r['name']:<24} {dist:<36} {r['status']}{reason}")
    return "\n".join(lines)
