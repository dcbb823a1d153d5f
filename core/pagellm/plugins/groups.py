"""The plugin groups: entry-point group names, their hook specifications and where they load."""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.plugins import hookspecs
from pagellm.plugins.hookspecs import PROJECT_NAME

GENERAL = "pagellm.general_plugins"
PLATFORM = "pagellm.platform_plugins"
ATTENTION = "pagellm.attention_backends"
QUANTIZATION = "pagellm.quantization_methods"
SCHEDULER_POLICY = "pagellm.scheduler_policies"
IO_PROCESSOR = "pagellm.io_processor_plugins"
STAT_LOGGER = "pagellm.stat_logger_plugins"
ENDPOINT = "pagellm.endpoint_plugins"
MODEL_FORMAT = "pagellm.model_formats"


@dataclass(frozen=True)
class PluginGroup:
    name: str
    spec: type
    loaded_in: str
    default_allow: bool = True
    """Whether plugins of the group load when VLLM_PLUGINS is unset (endpoints: deny by default)."""

    @property
    def hook(self) -> str:
        return next(n for n in vars(self.spec) if n.startswith(f"{PROJECT_NAME}_"))


GROUPS: dict[str, PluginGroup] = {
    g.name: g
    for g in (
        PluginGroup(GENERAL, hookspecs.GeneralPluginSpec, "every process"),
        PluginGroup(
            PLATFORM,
            hookspecs.PlatformPluginSpec,
            "every process, when current_platform is first read",
        ),
        PluginGroup(
            ATTENTION,
            hookspecs.AttentionBackendSpec,
            "where the attention backend is chosen and built (engine config, workers)",
        ),
        PluginGroup(
            QUANTIZATION,
            hookspecs.QuantizationMethodSpec,
            "where the engine config is built, and workers",
        ),
        PluginGroup(
            SCHEDULER_POLICY,
            hookspecs.SchedulerPolicySpec,
            "where the engine config is built, and the engine-core process",
        ),
        PluginGroup(IO_PROCESSOR, hookspecs.IOProcessorSpec, "front end only"),
        PluginGroup(STAT_LOGGER, hookspecs.StatLoggerSpec, "front end only"),
        PluginGroup(ENDPOINT, hookspecs.EndpointSpec, "API-server process only", False),
        PluginGroup(
            MODEL_FORMAT,
            hookspecs.ModelFormatSpec,
            (
                "where a GGUF model's config, tokenizer and weights are read (engine config, front end, workers)"
            ),
        ),
    )
}
