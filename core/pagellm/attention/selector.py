"""Choosing the attention backend: the user's choice, or the platform's ranking, checked against
what each backend declares it supports."""

from __future__ import annotations

import torch

from pagellm.attention.backend import AttentionBackend
from pagellm.attention.registry import get_backend_cls, registered_backends


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
) -> type[AttentionBackend]:
    """``ranking`` is the platform's preference order; installed backends it does not name come last."""
    candidates = [requested] if requested else [n for n in ranking if n in registered_backends()]
    if not requested:
        candidates += [n for n in registered_backends() if n not in candidates]
    rejected: dict[str, list[str]] = {}
    for name in candidates:
        try:
            cls = get_backend_cls(name)
        except (ImportError, AttributeError, TypeError) as exc:
            rejected[name] = [f"failed to import: {exc}"]
            continue
        reasons = cls.unsupported_reasons(
            device_type=device_type,
            head_size=head_size,
            dtype=dtype,
            block_size=block_size,
            sliding_window=sliding_window,
        )
        if not reasons:
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
        f"{block_size}, sliding window {sliding_window}, device {device_type}): {details}. "
        "Pass --block-size / --dtype to fit a backend, or choose one with --attention-backend."
    )
