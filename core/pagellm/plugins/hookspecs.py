"""The hook specifications: the contract of each plugin group, written down for pluggy.

A plugin is a module (named by its entry point) holding ``@hookimpl`` functions for the hooks of
its group, and a module-level ``pagellm_plugin_api = "MAJOR.MINOR"`` naming the plugin API it was
written for. Hook implementations may take fewer arguments than the specification, never others.
A hook that returns class paths may write them ``"pkg.module:Class"`` or ``"pkg.module.Class"``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pluggy

PROJECT_NAME = "pagellm"
PLUGIN_API_VERSION = "1.3"
"""Plugins declaring the same major version and a minor version up to this one are accepted.
1.1: the ``pagellm.scheduler_policies`` group; endpoint plugins' ``attach(app, ctx)``.
1.2: the ``pagellm.model_formats`` group (GGUF files are read by a plugin).
1.3: pooling models: ``EngineClient.encode``, endpoints with ``required_tasks={"embed"}``,
``AttentionBackend.supports_non_causal``, model classes' ``runners`` and ``is_causal``; platform
plugins may say why they are inactive (``pagellm_platform_inactive_reason``)."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@dataclass
class EndpointPlugin:
    """What an endpoint plugin's ``pagellm_endpoint`` hook returns.

    ``attach`` adds the plugin's routes to the API server's app: ``attach(app, engine_client)``
    for a plugin declaring API 1.0, ``attach(app, ctx)`` for 1.1.
    ``required_tasks``: the model tasks the routes need ({"generate"}, or {"embed"} for a pooling
    model's); None means any.
    """

    attach: Callable[..., None]
    required_tasks: frozenset[str] | None = None
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    api_version: str = field(default=PLUGIN_API_VERSION, init=False)
    """The plugin API version its module declares; set by the loader."""


class GeneralPluginSpec:
    """``pagellm.general_plugins``: loaded in every process (front end, engine core, workers)."""

    @hookspec
    def pagellm_register(self) -> None:
        """Side effects that every process must see, e.g. ``register_model(arch, "pkg.mod:Cls")``.
        Called once per process; must be safe to call in each process."""


class PlatformPluginSpec:
    """``pagellm.platform_plugins``: asked in every process when ``current_platform`` is first read."""

    @hookspec
    def pagellm_platform(self) -> str | None:
        """The class path of a `Platform` subclass when this platform's hardware is present,
        else None.

        The plugin module may also declare ``pagellm_platform_class = "pkg.module:Class"``, the
        path this hook answers when the hardware is present: the loader does not read it; tools
        that check an inactive platform's declarations (the conformance kit) do."""

    @hookspec
    def pagellm_platform_inactive_reason(self) -> str:
        """Optional (API 1.3): why `pagellm_platform` returned None, in a sentence a person can
        act on (e.g. "torch is not a ROCm build (torch.version.hip is None)"); asked only then,
        and shown by ``pagellm plugins``."""


class AttentionBackendSpec:
    """``pagellm.attention_backends``: loaded where the attention backend is chosen and built."""

    @hookspec
    def pagellm_attention_backends(self) -> dict[str, str]:
        """Backend name → class path of its `AttentionBackend` (imported only when chosen)."""


class QuantizationMethodSpec:
    """``pagellm.quantization_methods``: loaded where the engine config is built and in workers."""

    @hookspec
    def pagellm_quantization_methods(self) -> dict[str, str]:
        """Method name (what ``--quantization`` takes) → class path of its `QuantizationConfig`."""


class SchedulerPolicySpec:
    """``pagellm.scheduler_policies``: loaded where the engine config is built and in the
    engine-core process (API 1.1)."""

    @hookspec
    def pagellm_scheduler_policies(self) -> dict[str, str]:
        """Policy name (what ``--scheduling-policy`` takes) → class path of its `SchedulingPolicy`."""


class ModelFormatSpec:
    """``pagellm.model_formats``: loaded where a model file of such a format is read (API 1.2)."""

    @hookspec
    def pagellm_model_formats(self) -> dict[str, str]:
        """Format name (a ``load_format`` value, e.g. ``gguf``) → class path of its `ModelFormat`."""


class IOProcessorSpec:
    """``pagellm.io_processor_plugins``: loaded in the front end only."""

    @hookspec
    def pagellm_io_processors(self) -> dict[str, str]:
        """IO processor name → class path of its class."""


class StatLoggerSpec:
    """``pagellm.stat_logger_plugins``: loaded in the front end only."""

    @hookspec
    def pagellm_stat_loggers(self) -> dict[str, str]:
        """Stat logger name → class path of its `StatLoggerBase` subclass."""


class EndpointSpec:
    """``pagellm.endpoint_plugins``: loaded in the API-server process only, deny-by-default."""

    @hookspec
    def pagellm_endpoint(self) -> EndpointPlugin:
        """The routes to attach and the model tasks they need."""
