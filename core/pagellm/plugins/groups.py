"""The plugin groups: entry-point group names, their hook specifications, what their hook returns
and where they load."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagellm.plugins import hookspecs
from pagellm.plugins.hookspecs import PROJECT_NAME, EndpointPlugin

GENERAL = "pagellm.general_plugins"
PLATFORM = "pagellm.platform_plugins"
ATTENTION = "pagellm.attention_backends"
QUANTIZATION = "pagellm.quantization_methods"
SCHEDULER_POLICY = "pagellm.scheduler_policies"
IO_PROCESSOR = "pagellm.io_processor_plugins"
STAT_LOGGER = "pagellm.stat_logger_plugins"
ENDPOINT = "pagellm.endpoint_plugins"


def _is_class_map(result: Any) -> bool:
    return isinstance(result, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in result.items()
    )


_CLASS_MAP = ("a dict of name -> 'package.module:Class'", _is_class_map)


@dataclass(frozen=True)
class PluginGroup:
    name: str
    spec: type
    loaded_in: str
    returns: tuple[str, Callable[[Any], bool]]
    """What its hook must return: in words, and the check."""
    default_allow: bool = True
    """Whether plugins of the group load when VLLM_PLUGINS is unset (endpoints: deny by default)."""

    @property
    def hook(self) -> str:
        """The group's one hook."""
        return next(n for n in vars(self.spec) if n.startswith(f"{PROJECT_NAME}_"))


GROUPS: dict[str, PluginGroup] = {
    g.name: g
    for g in (
        PluginGroup(
            GENERAL,
            hookspecs.GeneralPluginSpec,
            "every process",
            ("None", lambda result: result is None),
        ),
        PluginGroup(
            PLATFORM,
            hookspecs.PlatformPluginSpec,
            "every process, when current_platform is first read",
            ("'package.module:PlatformClass' or None", lambda r: r is None or isinstance(r, str)),
        ),
        PluginGroup(
            ATTENTION,
            hookspecs.AttentionBackendSpec,
            "where the attention backend is chosen and built (engine config, workers)",
            _CLASS_MAP,
        ),
        PluginGroup(
            QUANTIZATION,
            hookspecs.QuantizationMethodSpec,
            "where the engine config is built, and workers",
            _CLASS_MAP,
        ),
        PluginGroup(
            SCHEDULER_POLICY,
            hookspecs.SchedulerPolicySpec,
            "where the engine config is built, and the engine-core process",
            _CLASS_MAP,
        ),
        PluginGroup(IO_PROCESSOR, hookspecs.IOProcessorSpec, "front end only", _CLASS_MAP),
        PluginGroup(STAT_LOGGER, hookspecs.StatLoggerSpec, "front end only", _CLASS_MAP),
        PluginGroup(
            ENDPOINT,
            hookspecs.EndpointSpec,
            "API-server process only",
            ("a pagellm.plugins.EndpointPlugin", lambda r: isinstance(r, EndpointPlugin)),
            default_allow=False,
        ),
    )
}
