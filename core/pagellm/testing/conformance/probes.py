"""The values the kit tries on a backend: each one it declares, one of each kind it does not, and
the layer the other cases run with, all read from its class attributes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagellm.attention.backend import AttentionBackend
from pagellm.attention.selector import NoAttentionBackendError, select_attention_backend
from pagellm.testing.conformance.paged import LayerShape
from pagellm.testing.conformance.targets import BackendTarget

ANY_HEAD_SIZE_PROBES = (64, 128)
"""Head sizes tried on a backend that declares any (``supported_head_sizes = None``)."""
PREFERRED_HEAD_SIZES = (32, 64, 128, 16, 256)
"""The cases' head size: the first one the backend serves (small ones run fastest)."""
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
DEVICE_TYPES = ("cpu", "cuda", "xpu", "hpu", "mps", "meta")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
SLIDING_WINDOW = 8


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def declared_dtypes(cls: type[AttentionBackend]) -> list[torch.dtype]:
    return list(cls.supported_dtypes)


def declared_head_sizes(cls: type[AttentionBackend]) -> list[int]:
    return list(cls.supported_head_sizes or ANY_HEAD_SIZE_PROBES)


def declared_block_sizes(cls: type[AttentionBackend]) -> list[int]:
    multiple = cls.block_size_multiple
    return sorted({multiple, 2 * multiple, cls.default_block_size})


def declared_kv_cache_dtypes(cls: type[AttentionBackend]) -> list[str]:
    return list(cls.supported_kv_cache_dtypes)


@dataclass(frozen=True)
class Selection:
    """The arguments of one `select_attention_backend` call, and how to name them."""

    what: str
    """e.g. ``head size 24``: what a refusal's reason must mention (``24``)."""
    mention: str
    kwargs: dict[str, Any]


def selection(target: BackendTarget, what: str = "", mention: str = "", **over: Any) -> Selection:
    """A selection of ``target`` on its platform's device type with the cases' defaults, changed
    by ``over``."""
    cls = target.require_class()
    kwargs: dict[str, Any] = dict(
        device_type=target.device_type or cls.supported_device_types[0],
        head_size=default_head_size(target),
        dtype=default_dtype(cls),
        block_size=cls.default_block_size,
        sliding_window=None,
        kv_cache_dtype="auto",
    )
    return Selection(what, mention, {**kwargs, **over})


def select(target: BackendTarget, chosen: Selection) -> type[AttentionBackend]:
    """The selector asked for ``target`` alone (``--attention-backend``)."""
    return select_attention_backend(requested=target.name, ranking=[], **chosen.kwargs)


def reasons(target: BackendTarget, chosen: Selection) -> list[str]:
    return target.require_class().unsupported_reasons(**chosen.kwargs)


def undeclared_selections(target: BackendTarget) -> list[Selection]:
    """One value of each kind the backend does not declare (none of a kind it declares all of)."""
    cls = target.require_class()
    out = []
    dtype = next((d for d in DTYPES if d not in cls.supported_dtypes), None)
    if dtype is not None:
        name = dtype_name(dtype)
        out.append(selection(target, f"dtype {name}", name, dtype=dtype))
    if cls.supported_head_sizes is not None:
        size = next(s for s in range(8, 1024, 8) if s not in cls.supported_head_sizes)
        out.append(selection(target, f"head size {size}", str(size), head_size=size))
    if cls.block_size_multiple > 1:
        size = cls.block_size_multiple + cls.block_size_multiple // 2
        out.append(selection(target, f"block size {size}", str(size), block_size=size))
    if not cls.supports_sliding_window:
        out.append(
            selection(target, "a sliding window", "sliding window", sliding_window=SLIDING_WINDOW)
        )
    device = next(d for d in DEVICE_TYPES if d not in cls.supported_device_types)
    out.append(selection(target, f"device type {device}", device, device_type=device))
    kv = next((k for k in KV_CACHE_DTYPES if k not in cls.supported_kv_cache_dtypes), None)
    if kv is not None:
        out.append(selection(target, f"kv cache dtype {kv}", kv, kv_cache_dtype=kv))
    return out


def default_dtype(cls: type[AttentionBackend]) -> torch.dtype:
    """float32 when declared (the tightest comparison), else the first declared dtype."""
    return torch.float32 if torch.float32 in cls.supported_dtypes else cls.supported_dtypes[0]


_head_sizes: dict[str, int] = {}


def default_head_size(target: BackendTarget) -> int:
    """The first of `PREFERRED_HEAD_SIZES` the backend declares and does not refuse here."""
    if target.name not in _head_sizes:
        _head_sizes[target.name] = _first_served_head_size(target)
    return _head_sizes[target.name]


def _first_served_head_size(target: BackendTarget) -> int:
    cls = target.require_class()
    declared = [s for s in PREFERRED_HEAD_SIZES if s in declared_head_sizes(cls)] or [
        min(declared_head_sizes(cls))
    ]
    if target.unusable is None:
        for size in declared:
            try:
                select_attention_backend(
                    requested=target.name,
                    ranking=[],
                    device_type=str(target.device_type),
                    head_size=size,
                    dtype=default_dtype(cls),
                    block_size=cls.default_block_size,
                    sliding_window=None,
                )
            except NoAttentionBackendError:
                continue
            return size
    return declared[0]


def default_shape(target: BackendTarget, **over: Any) -> LayerShape:
    """The layer of the cases that do not choose one: 2 query heads, 2 KV heads, the default
    dtype and head size, the default block size; ``over`` changes any field."""
    cls = target.require_class()
    fields: dict[str, Any] = dict(
        num_heads=2,
        num_kv_heads=2,
        head_size=default_head_size(target),
        dtype=default_dtype(cls),
        block_size=cls.default_block_size,
    )
    return LayerShape(**{**fields, **over})
