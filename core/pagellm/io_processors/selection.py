"""Which IO processor a model runs with, and building it: the registry of installed processors,
the name's resolution (``--io-processor``, else the model config's ``io_processor_plugin``) and
the error that lists the installed ones when the named one is missing."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagellm.io_processors.base import IOProcessor
from pagellm.plugins.groups import IO_PROCESSOR
from pagellm.plugins.registry import NotRegisteredError, Registry

if TYPE_CHECKING:
    from pagellm.config import EngineConfig

io_processors: Registry[IOProcessor[Any, Any]] = Registry("IO processor", IOProcessor, IO_PROCESSOR)

CONFIG_FIELD = "io_processor_plugin"
"""The model config.json's field naming its IO processor (vLLM's name)."""


class IOProcessorNotInstalledError(NotRegisteredError):
    """The IO processor a flag or the model's config names is not installed."""


def resolve_io_processor_name(requested: str | None, hf_config: Any) -> str | None:
    """The IO processor to use: ``requested`` (``--io-processor``), else the model config's
    ``io_processor_plugin``, else None (plain prompts, plain outputs). A named processor must be
    installed: otherwise `IOProcessorNotInstalledError`, listing the installed ones."""
    from_config = getattr(hf_config, CONFIG_FIELD, None)
    name = requested or from_config
    if not name:
        return None
    if not isinstance(name, str):
        raise ValueError(f"The model config's {CONFIG_FIELD} must be a string, got {name!r}.")
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
