"""Choosing the attention backend: the user's choice, or the platform's ranking, checked against
what each backend declares it supports."""

from __future__ import annotations

import logging

import torch

from pagellm.attention.backend import AttentionBackend
from pagellm.attention.registry import attention_backends
from pagellm.platforms import current_platform_name
from pagellm.plugins.loader import PluginError

logger = logging.getLogger(__name__)


class NoAttentionBackendError(ValueError):
    pass


def select_attention_backend(
    *,
    requested: str | None,
    ranking: list[str],
    device_type: str,
    head_size: int,
    dtype: torch.dtype,
    block_size: int | None,
    sliding_window: int | None,
    kv_cache_dtype: str = "auto",
    causal: bool = True,
) -> type[AttentionBackend]:
    """``ranking`` is the platform's preference order; installed backends it does not name come
    last. ``causal`` False: an encoder's bidirectional attention (`supports_non_causal`). Logs
    the choice, with every backend passed over and why, at INFO."""
    installed = attention_backends.names()
    candidates = [requested] if requested else [n for n in ranking if n in installed]
    if not requested:
        candidates += [n for n in installed if n not in candidates]
    rejected: dict[str, list[str]] = {}
    for name in candidates:
        try:
            cls = attention_backends.get(name)
        except PluginError as exc:
            rejected[name] = [str(exc)]
            continue
        reasons = cls.unsupported_reasons(
            device_type=device_type,
            head_size=head_size,
            dtype=dtype,
            block_size=block_size,
            sliding_window=sliding_window,
            kv_cache_dtype=kv_cache_dtype,
        )
        if not causal and not cls.supports_non_causal:
            reasons.append("non-causal (bidirectional, encoder) attention not supported")
        if not reasons:  # one start-up line: what was chosen, and what was passed over and why
            passed_over = "".join(f"; {n} rejected: {', '.join(r)}" for n, r in rejected.items())
            size = block_size or cls.default_block_size_for(kv_cache_dtype)
            kv = "" if kv_cache_dtype == "auto" else f", kv cache dtype {kv_cache_dtype}"
            logger.info(
                f"Platform {current_platform_name()}: attention backend {name}, block size {size}, "
                f"dtype {str(dtype).removeprefix('torch.')}{kv}{passed_over}"
            )
            return cls
        rejected[name] = reasons
    details = "; ".join(f"{name}: {', '.join(r)}" for name, r in rejected.items())
    what = (
        f"attention backend {requested!r} cannot"
        if requested
        else "no installed attention backend can"
    )
    raise NoAttentionBackendError(
        f"{what} serve this model (head size {head_size}, dtype {dtype}, block size "
        f"{block_size}, sliding window {sliding_window}, kv cache dtype {kv_cache_dtype}, "
        f"{'causal' if causal else 'non-causal'} attention, device {device_type}): {details}. "
        "Pass --block-size / --dtype / --kv-cache-dtype to fit a backend, or choose one with "
        "--attention-backend."
    )
