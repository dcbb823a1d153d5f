"""Capability declarations, honoured: what a platform and a backend declare is well formed; the
selector (`pagellm.attention.selector`) accepts every dtype, head size, block size and KV cache
dtype a backend declares and refuses, with a reason naming it, one of each kind it does not; and
every declared value runs, matching TORCH_SDPA."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from pagellm.attention.selector import NoAttentionBackendError, select_attention_backend
from pagellm.testing.conformance.compare import ConformanceFailure
from pagellm.testing.conformance.paged import assert_matches_reference
from pagellm.testing.conformance.probes import (
    SLIDING_WINDOW,
    Selection,
    default_shape,
    dtype_name,
    reasons,
    select,
    selection,
)
from pagellm.testing.conformance.scenarios import MIXED
from pagellm.testing.conformance.targets import BackendTarget, PlatformTarget

TYPICAL_HEAD_SIZES = (64, 128)


def _problems(checks: dict[str, bool]) -> None:
    failed = [what for what, ok in checks.items() if not ok]
    if failed:
        raise ConformanceFailure("; ".join(failed))


# ---------------------------------------------------------------------------- platform


def test_platform_declarations_are_well_formed(platform: PlatformTarget) -> None:
    cls = platform.require_class()
    try:
        torch.device(cls.device_type)
        device_ok = True
    except (RuntimeError, TypeError):
        device_ok = False
    ranking = cls.attention_backend_ranking()
    dtypes = cls.supported_dtypes
    _problems(
        {
            f"device_type {cls.device_type!r} is not a torch device type": device_ok,
            f"supported_dtypes {dtypes!r} is not a non-empty tuple of floating dtypes": (
                isinstance(dtypes, tuple)
                and bool(dtypes)
                and all(isinstance(d, torch.dtype) and d.is_floating_point for d in dtypes)
            ),
            f"attention_backend_ranking() returned {ranking!r}, not a list of names": (
                isinstance(ranking, list) and all(isinstance(n, str) for n in ranking)
            ),
            f"dist_backend {cls.dist_backend!r} is not a torch.distributed backend name": (
                isinstance(cls.dist_backend, str) and bool(cls.dist_backend)
            ),
            "needs_warm_up and async_scheduling_default must be bools": (
                isinstance(cls.needs_warm_up, bool)
                and isinstance(cls.async_scheduling_default, bool)
            ),
        }
    )


def test_platform_auto_dtype_is_one_it_supports(platform: PlatformTarget) -> None:
    cls = platform.require_class()
    if not platform.active:  # default_dtype may ask the device (the CUDA platform's does)
        pytest.skip(str(platform.inactive_reason))
    for checkpoint in (None, torch.float32, torch.float16, torch.bfloat16):
        chosen = cls.default_dtype(checkpoint)
        if chosen not in cls.supported_dtypes:
            raise ConformanceFailure(
                f"default_dtype({checkpoint}) is {chosen}, which supported_dtypes "
                f"{cls.supported_dtypes} does not list: dtype='auto' would be refused"
            )


@pytest.mark.parametrize("head_size", TYPICAL_HEAD_SIZES)
def test_platform_ranking_serves_a_typical_model(
    platform: PlatformTarget, head_size: int, record_property: Callable[[str, object], None]
) -> None:
    """Selection as the engine makes it on this platform, for a model of a common head size;
    the backend chosen is recorded in the report (property ``backend``)."""
    cls = platform.require_class()
    try:
        chosen = select_attention_backend(
            requested=None,
            ranking=cls.attention_backend_ranking(),
            device_type=cls.device_type,
            head_size=head_size,
            dtype=cls.supported_dtypes[0],
            block_size=None,
            sliding_window=None,
        )
    except NoAttentionBackendError as exc:
        raise ConformanceFailure(f"platform {platform.name}: {exc}") from None
    record_property("backend", chosen.name)


# ---------------------------------------------------------------------------- backend


def test_backend_declarations_are_well_formed(backend: BackendTarget) -> None:
    cls = backend.require_class()
    sizes, multiple = cls.supported_head_sizes, cls.block_size_multiple
    available = cls.is_available()
    _problems(
        {
            f"supported_dtypes {cls.supported_dtypes!r} is not a non-empty tuple of dtypes": (
                bool(cls.supported_dtypes)
                and all(isinstance(d, torch.dtype) for d in cls.supported_dtypes)
            ),
            f"supported_head_sizes {sizes!r} is neither None nor a tuple of positive ints": (
                sizes is None or (bool(sizes) and all(isinstance(s, int) and s > 0 for s in sizes))
            ),
            f"block_size_multiple {multiple!r} is not a positive int": (
                isinstance(multiple, int) and multiple > 0
            ),
            f"default_block_size {cls.default_block_size} is not a multiple of "
            f"block_size_multiple {multiple}": cls.default_block_size % multiple == 0,
            f"supported_device_types {cls.supported_device_types!r} is empty": bool(
                cls.supported_device_types
            ),
            f"supported_kv_cache_dtypes {cls.supported_kv_cache_dtypes!r} lacks 'auto' (the "
            "model dtype)": "auto" in cls.supported_kv_cache_dtypes,
            f"is_available() returned {available!r}, neither None nor a reason": (
                available is None or (isinstance(available, str) and bool(available))
            ),
        }
    )


def test_kv_cache_shape_holds_exactly_the_pages(backend: BackendTarget, head_size: int) -> None:
    """The engine sizes the cache as 2 x blocks x block size x KV heads x head size elements."""
    cls = backend.require_class()
    for block_size in (cls.block_size_multiple, cls.default_block_size):
        for num_blocks, num_kv_heads in ((7, 1), (10, 4)):
            shape = cls.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
            expected = 2 * num_blocks * block_size * num_kv_heads * head_size
            if math.prod(shape) != expected:
                raise ConformanceFailure(
                    f"get_kv_cache_shape({num_blocks}, {block_size}, {num_kv_heads}, "
                    f"{head_size}) is {shape}: {math.prod(shape)} elements, not {expected}"
                )


def _assert_accepted(backend: BackendTarget, chosen: Selection, declaration: str) -> None:
    """Accepted by the selector; where the backend cannot run here, refused for no reason but
    the ones every selection of it gets here (its library missing, the device)."""
    cls = backend.require_class()
    baseline = reasons(backend, selection(backend))
    if baseline:
        extra = [r for r in reasons(backend, chosen) if r not in baseline]
        if extra:
            raise ConformanceFailure(
                f"{backend.name} declares {declaration}, yet refuses {chosen.what}: {extra}"
            )
        return
    try:
        chosen_cls = select(backend, chosen)
    except NoAttentionBackendError as exc:
        raise ConformanceFailure(
            f"{backend.name} declares {declaration}, yet the selector refuses {chosen.what}: {exc}"
        ) from None
    if chosen_cls is not cls:
        raise ConformanceFailure(f"the selector answered {chosen_cls} for {backend.name}")


def test_declared_dtype_is_accepted(backend: BackendTarget, dtype: torch.dtype) -> None:
    chosen = selection(backend, f"dtype {dtype_name(dtype)}", dtype=dtype)
    _assert_accepted(
        backend, chosen, f"supported_dtypes {backend.require_class().supported_dtypes}"
    )


def test_declared_head_size_is_accepted(backend: BackendTarget, head_size: int) -> None:
    cls = backend.require_class()
    declaration = f"supported_head_sizes {cls.supported_head_sizes}"
    _assert_accepted(
        backend, selection(backend, f"head size {head_size}", head_size=head_size), declaration
    )


def test_declared_block_size_is_accepted(backend: BackendTarget, block_size: int) -> None:
    cls = backend.require_class()
    declaration = f"block sizes that are multiples of {cls.block_size_multiple}"
    chosen = selection(backend, f"block size {block_size}", block_size=block_size)
    _assert_accepted(backend, chosen, declaration)


def test_declared_kv_cache_dtype_is_accepted(backend: BackendTarget, kv_cache_dtype: str) -> None:
    cls = backend.require_class()
    declaration = f"supported_kv_cache_dtypes {cls.supported_kv_cache_dtypes}"
    chosen = selection(backend, f"kv cache dtype {kv_cache_dtype}", kv_cache_dtype=kv_cache_dtype)
    _assert_accepted(backend, chosen, declaration)


def test_declared_sliding_window_is_accepted(backend: BackendTarget) -> None:
    if not backend.require_class().supports_sliding_window:
        pytest.skip(f"{backend.name} declares supports_sliding_window = False")
    chosen = selection(backend, "a sliding window", sliding_window=SLIDING_WINDOW)
    _assert_accepted(backend, chosen, "supports_sliding_window = True")


def test_undeclared_value_is_refused_with_a_reason(
    backend: BackendTarget, undeclared: Selection
) -> None:
    try:
        select(backend, undeclared)
    except NoAttentionBackendError:
        own = reasons(backend, undeclared)
        if not any(undeclared.mention in r for r in own):
            raise ConformanceFailure(
                f"the selector refuses {undeclared.what} for {backend.name}, but none of its "
                f"reasons names it ({own}): unsupported_reasons must say what is not supported"
            ) from None
        return
    raise ConformanceFailure(
        f"{backend.name} does not declare {undeclared.what}, yet the selector accepts it"
    )


# ---------------------------------------------------------------------------- declared values run


def _runs(backend: BackendTarget, chosen: Selection, **shape: object) -> None:
    cls = backend.skip_unless_usable()
    refused = reasons(backend, chosen)
    if refused:  # the case accepting it has failed with these
        pytest.skip(f"{backend.name} refuses {chosen.what} here: {refused}")
    assert_matches_reference(cls, default_shape(backend, **shape), MIXED, backend.device())


def test_declared_dtype_runs(backend: BackendTarget, dtype: torch.dtype) -> None:
    _runs(backend, selection(backend, f"dtype {dtype_name(dtype)}", dtype=dtype), dtype=dtype)


def test_declared_head_size_runs(backend: BackendTarget, head_size: int) -> None:
    chosen = selection(backend, f"head size {head_size}", head_size=head_size)
    _runs(backend, chosen, head_size=head_size)


def test_declared_block_size_runs(backend: BackendTarget, block_size: int) -> None:
    chosen = selection(backend, f"block size {block_size}", block_size=block_size)
    _runs(backend, chosen, block_size=block_size)


def test_declared_kv_cache_dtype_runs(backend: BackendTarget, kv_cache_dtype: str) -> None:
    chosen = selection(backend, f"kv cache dtype {kv_cache_dtype}", kv_cache_dtype=kv_cache_dtype)
    _runs(backend, chosen, kv_cache_dtype=kv_cache_dtype)
