"""The hook specifications: the contract of each plugin group, written down for pluggy.

A plugin is a module (named by its entry point) holding ``@hookimpl`` functions for the hooks of
its group, and a module-level ``pagellm_plugin_api = "MAJOR.MINOR"`` naming the plugin API it was
written for. Hook implementations may take fewer arguments than the specification, never others.
"""

from __future__ import annotations

from typing import Any

import pluggy

PROJECT_NAME = "pagellm"
PLUGIN_API_VERSION = "1.1"
"""Plugins declaring the same major version and a minor version up to this one are accepted."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


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
        """The qualified name (``"pkg.module:Class"``) of a `Platform` subclass when this
        platform's hardware is present, else None."""


class AttentionBackendSpec:
    """``pagellm.attention_backends``: loaded where the attention backend is chosen and built."""

    @hookspec
    def pagellm_attention_backends(self) -> dict[str, str]:
        """Backend name → qualified name of its `AttentionBackend` class (imported only when chosen)."""


class QuantizationMethodSpec:
    """``pagellm.quantization_methods``: loaded where the engine config is built and in workers."""

    @hookspec
    def pagellm_quantization_methods(self) -> dict[str, str]:
        """Method name (what ``--quantization`` takes) → qualified name of its `QuantizationConfig`."""


class IOProcessorSpec:
    """``pagellm.io_processor_plugins``: loaded in the front end only."""

    @hookspec
    def pagellm_io_processors(self) -> dict[str, str]:
        """IO processor name → qualified name of its class."""


class StatLoggerSpec:
    """``pagellm.stat_logger_plugins``: loaded in the front end only."""

    @hookspec
    def pagellm_stat_loggers(self) -> dict[str, str]:
        """Stat logger name → qualified name of its class."""


class EndpointSpec:
    """``pagellm.endpoint_plugins``: loaded in the API-server process only, deny-by-default."""

    @hookspec
    def pagellm_endpoint(self) -> Any:
        """An `EndpointPlugin`: the routes to attach and the model tasks they need."""
