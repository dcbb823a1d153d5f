"""Which quantization method an engine runs: the one asked for, or the one the checkpoint's
``quantization_config`` calls for, and never two that disagree."""

from __future__ import annotations

import logging
from typing import Any

from pagellm.plugins.loader import PluginError
from pagellm.quantization.registry import quantization_methods

logger = logging.getLogger(__name__)


def _methods_reading(checkpoint_config: dict[str, Any]) -> list[str]:
    names = []
    for name in quantization_methods.names():
        try:
            method = quantization_methods.get(name)
        except PluginError as exc:  # one broken plugin must not hide the others
            logger.warning("Quantization method %r skipped: %s", name, exc)
            continue
        if method.matches_checkpoint(checkpoint_config):
            names.append(name)
    return names


def resolve_quantization(
    requested: str | None, checkpoint_config: dict[str, Any] | None
) -> str | None:
    """The method's registered name, or None for dense weights; ValueError when the checkpoint is
    quantized in a way no installed method reads, or ``requested`` contradicts it."""
    if not checkpoint_config:
        return requested
    scheme = checkpoint_config.get("quant_method", "?")
    readers = _methods_reading(checkpoint_config)
    if requested is not None:
        if requested in readers or not readers:
            # No reader at all: the requested method gets the config and judges it itself.
            return requested
        raise ValueError(
            f"quantization={requested!r} conflicts with the checkpoint, which is quantized with "
            f"quant_method {scheme!r} (read by {', '.join(readers)}); drop --quantization to use "
            "the checkpoint's method."
        )
    if len(readers) == 1:
        return readers[0]
    if not readers:
        installed = ", ".join(quantization_methods.names()) or "none"
        raise ValueError(
            f"The checkpoint is quantized with quant_method {scheme!r} "
            f"({_describe(checkpoint_config)}), which no installed quantization method reads "
            f"(installed: {installed}); install a plugin that reads it."
        )
    raise ValueError(
        f"Several installed quantization methods read this checkpoint ({', '.join(readers)}); "
        "choose one with --quantization."
    )


def _describe(checkpoint_config: dict[str, Any]) -> str:
    keys = sorted(k for k in checkpoint_config if k != "quant_method")
    return "keys: " + ", ".join(keys[:6]) if keys else "no other keys"
