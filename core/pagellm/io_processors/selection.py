"""Which IO processor a model runs with, and building it: the registry of installed processors,
the name's resolution (``--io-processor``, else the model config's ``io_processor_plugin``, else
the one the model's architecture names) and the error that lists the installed ones when the named
one is missing."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from pagellm.config import ConfigError
from pagellm.io_processors.base import IOProcessor
from pagellm.plugins.groups import IO_PROCESSOR
from pagellm.plugins.registry import NotRegisteredError, Registry

if TYPE_CHECKING:
    from pagellm.config import EngineConfig

io_processors: Registry[IOProcessor[Any, Any]] = Registry("IO processor", IOProcessor, IO_PROCESSOR)

logger = logging.getLogger(__name__)

CONFIG_FIELD = "io_processor_plugin"
"""The model config.json's field naming its IO processor (vLLM's name)."""


class IOProcessorNotInstalledError(NotRegisteredError, ConfigError):
    """The IO processor a flag or the model's config names is not installed."""


def resolve_io_processor_name(
    requested: str | None, hf_config: Any, model_cls: type | None = None
) -> str | None:
    """The IO processor to use: ``requested`` (``--io-processor``), else the model config's
    ``io_processor_plugin``, else the model class's ``default_io_processor`` (LLaVA's is
    ``image``), else None (plain prompts, plain outputs).
    A processor the flag or the config names must be installed: otherwise
    `IOProcessorNotInstalledError` (a `ConfigError`), listing the installed ones. The architecture's default is only
    logged when it is missing: the model still runs, on text."""
    from_config = getattr(hf_config, CONFIG_FIELD, None)
    architecture_default = getattr(model_cls, "default_io_processor", None)
    name = requested or from_config
    if not name:
        if architecture_default and architecture_default not in io_processors:
            logger.warning(
                "The model's architecture takes its media through the IO processor %r, which "
                "is not installed (installed: %s): it runs on text prompts only.",
                architecture_default,
                ", ".join(io_processors.names()) or "none",
            )
            return None
        return architecture_default
    if not isinstance(name, str):
        raise ConfigError(f"The model config's {CONFIG_FIELD} must be a string, got {name!r}.")
    if name not in io_processors:
        installed = ", ".join(io_processors.names()) or "none"
        source = (
            "--io-processor (io_processor)"
            if requested
            else f"the model config.json's {CONFIG_FIELD}"
        )
        raise IOProcessorNotInstalledError(
            f"IO processor {name!r} (named by {source}) is not installed; installed: "
            f"{installed}. Install the package that provides it (pagellm-io-<name> for the "
            "first-party ones), or pass --io-processor with an installed one."
        )
    return name


def build_io_processor(config: EngineConfig, tokenizer: Any) -> IOProcessor[Any, Any] | None:
    """The engine config's IO processor (``config.model.io_processor``), built for this front
    end; None when the model needs none."""
    name = config.model.io_processor
    if name is None:
        return None
    return io_processors.get(name)(config, tokenizer)
