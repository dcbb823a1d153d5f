"""The plugin groups: entry-point group names, their hook specifications and where they load."""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.plugins import hookspecs

GENERAL = "pagellm.general_plugins"
PLATFORM = "pagellm.platform_plugins"
ATTENTION = "pagellm.attention_backends"
QUANTIZATION = "pagellm.quantization_methods"
IO_PROCESSOR = "pagellm.io_processor_plugins"
STAT_LOGGER = "pagellm.stat_logger_plugins"
ENDPOINT = "pagellm.endpoint_plugins"


@dataclass(frozen=True)
class PluginGroup:
    name: str
    spec: type
    loaded_in: str
    default_allow: bool
    """Whether plugins of the group load when VLLM_PLUGINS is unset (endpoints: deny by default)."""


GROUPS: dict[str, PluginGroup] = {
    g.name: g
    for g in (
        PluginGroup(GENERAL, hookspecs.GeneralPluginSpec, "every process", True),
        PluginGroup(
            PLATFORM,
            hookspecs.PlatformPluginSpec,
            "every process, when current_platform is first read",
            True,
        ),
        PluginGroup(
            ATTENTION,
            hookspecs.AttentionBackendSpec,
            "where the attention backend is chosen and built (engine config, workers)",
            True,
        ),
        PluginGroup(
            QUANTIZATION,
            hookspecs.QuantizationMethodSpec,
            "where the engine config is built, and workers",
            True,
        ),
        PluginGroup(IO_PROCESSOR, hookspecs.IOProcessorSpec, "front end only", True),
        PluginGroup(STAT_LOGGER, hookspecs.StatLoggerSpec, "front end only", True),
        PluginGroup(ENDPOINT, hookspecs.EndpointSpec, "API-server process only", False),
    )
}
