"""Stand-ins for the FlashAttention builds, for CPU tests: the real ones need a GPU.

Each fake is a module put in ``sys.modules`` under the real module's name, with the real entry
point's signature (read from the wheels: flash-attn-4 4.0.0b36's ``flash_attn.cute``, vLLM
0.25.1's ``vllm.vllm_flash_attn.flash_attn_interface``, flash-attn 2.8's ``flash_attn``). It
checks its arguments as the real one does (dtypes, shapes, contiguity), records every call, and
computes the attention the real one documents, in torch: paged K/V through the page table,
causal aligned to the bottom right, ``seqused_q``/``seqused_k``, the left window. The FA4 fake
also fills its compile cache on each new variant, as FA4's JIT does.
"""

from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from pagellm_flash_attn.kernels import base, fa2, fa3, fa4
from pagellm_flash_attn.kernels.fa4_setup import CACHE_ENABLED_VAR

FA4_COPIES_STRIDED_QUERY = False
"""Make the fake FA4 copy every non-contiguous query (as a release without strided reads would)."""


@dataclass
class Recorder:
    calls: list[dict[str, Any]] = field(default_factory=list)
    launches: int = 0
    """FA4's compiled kernel launches (through its entry point, or replayed by the backend)."""
    last_out: torch.Tensor | None = None
    """The output tensor FA4's last kernel launch wrote."""
    allow_float32: bool = False
    """Accept float32 (the real builds take half precision only), for exact engine tests."""


def _check_half(recorder: Recorder, *tensors: torch.Tensor) -> None:
    allowed = (torch.float16, torch.bfloat16) + ((torch.float32,) if recorder.allow_float32 else ())
    for t in tensors:
        if t.dtype not in allowed:
            raise AssertionError(f"inputs must be float16 or bfloat16, got {t.dtype}")


def _check_int32(**tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and (t.dtype != torch.int32 or t.stride(-1) != 1):
            raise AssertionError(f"{name} must be contiguous int32")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    q_lens: list[int],
    k_lens: list[int],
    page_table: torch.Tensor,
    scale: float,
    causal: bool,
    window_left: int | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """What the builds compute: row b's first q_lens[b] queries (from cu_seqlens_q[b]) attend
    its first k_lens[b] keys, read page by page; causal aligned to the bottom right."""
    _, page_size, num_kv_heads, head_size = k_cache.shape
    group = q.shape[1] // num_kv_heads
    for b, (q_len, k_len) in enumerate(zip(q_lens, k_lens, strict=True)):
        start = int(cu_seqlens_q[b])
        if q_len == 0:
            continue
        if k_len == 0:
            out[start : start + q_len] = 0
            continue
        pages = page_table[b, : math.ceil(k_len / page_size)].long()
        k = k_cache[pages].reshape(-1, num_kv_heads, head_size)[:k_len].double()
        v = v_cache[pages].reshape(-1, num_kv_heads, head_size)[:k_len].double()
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start : start + q_len].double(), k) * scale
        q_pos = torch.arange(k_len - q_len, k_len).unsqueeze(1)
        k_pos = torch.arange(k_len).unsqueeze(0)
        visible = k_pos <= q_pos if causal else torch.ones_like(k_pos <= q_pos)
        if window_left is not None:
            visible &= k_pos >= q_pos - window_left
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


class FakeJitCache:
    """FA4's in-memory compile cache (``flash_attn.cute.cache_utils.JITCache``)."""

    def __init__(self) -> None:
        self.cache: dict[Any, Any] = {}

    def __setitem__(self, key: Any, fn: Any) -> None:
        self.cache[key] = fn

    def __getitem__(self, key: Any) -> Any:
        return self.cache[key]

    def __contains__(self, key: Any) -> bool:
        return key in self.cache


def fake_fa4(recorder: Recorder) -> dict[str, types.ModuleType]:
    """``flash_attn.cute`` of flash-attn-4: ``flash_attn_varlen_func`` returns (out, lse). As
    the real one, it launches a "compiled" kernel from its compile cache with sm_90's argument
    layout (q, k, v, out, lse, scale, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
    page_table, window left, window right, sink, ...)."""
    compile_cache = FakeJitCache()

    def compile_kernel(causal: bool) -> Any:
        def kernel(q, k, v, out, lse, scale, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                   page_table, window_left, window_right, *rest):  # fmt: skip
            recorder.launches += 1
            recorder.last_out = out
            q_lens = (seqused_q if seqused_q is not None else cu_seqlens_q.diff()).tolist()
            paged_attention(
                q, k, v, cu_seqlens_q, q_lens, seqused_k.tolist(), page_table, scale, causal,
                window_left, out,
            )  # fmt: skip

        return kernel

    def flash_attn_varlen_func(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        qv: Any = None,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_k: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None,
        min_seqlen_k: int | None = None,
        seqused_q: torch.Tensor | None = None,
        seqused_k: torch.Tensor | None = None,
        gather_kv_indices: Any = None,
        page_table: torch.Tensor | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int | None, int | None] = (None, None),
        num_splits: int = 1,
        **rest: Any,
    ) -> tuple[torch.Tensor, None]:
        recorder.calls.append(dict(locals()))
        _check_half(recorder, q, k, v)
        _check_int32(
            cu_seqlens_q=cu_seqlens_q,
            seqused_q=seqused_q,
            seqused_k=seqused_k,
            page_table=page_table,
        )
        assert cu_seqlens_k is None and page_table is not None and cu_seqlens_q is not None
        batch = cu_seqlens_q.shape[0] - 1
        assert page_table.shape[0] == batch and k.shape == v.shape and k.dim() == 4
        assert seqused_k is not None and seqused_k.shape == (batch,)
        assert seqused_q is None or seqused_q.shape == (batch,)
        assert q.shape[1] % k.shape[2] == 0
        assert window_size[1] in (None, 0), "causal windows only"
        variant = (q.dtype, q.shape[1:], seqused_q is None, max_seqlen_q == 1, num_splits, causal)
        cache = interface._flash_attn_fwd.compile_cache  # looked up per call, as FA4 does
        if variant not in cache:
            cache[variant] = compile_kernel(causal)
        # As FA4's `maybe_contiguous`: an aligned layout as it is, anything else copied.
        size = q.element_size()
        aligned = (
            q.stride(-1) == 1
            and q.data_ptr() % 16 == 0
            and all(stride * size % 16 == 0 for stride in q.stride()[:-1])
        )
        q = (
            q
            if aligned and not (FA4_COPIES_STRIDED_QUERY and not q.is_contiguous())
            else q.contiguous()
        )
        out = torch.full(q.shape, float("nan"), dtype=q.dtype)  # rows left alone stay NaN
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        cache[variant](
            q, k, v, out, None, scale, cu_seqlens_q, None, seqused_q, seqused_k, page_table,
            window_size[0], window_size[1], None, None, None, None, None,
        )  # fmt: skip
        return out, None

    interface = _module("flash_attn.cute.interface", _flash_attn_fwd=types.SimpleNamespace())
    interface._flash_attn_fwd.compile_cache = compile_cache
    cute = _module(
        "flash_attn.cute", flash_attn_varlen_func=flash_attn_varlen_func, interface=interface
    )
    return {
        "flash_attn": _module("flash_attn", cute=cute, __path__=[]),
        "flash_attn.cute": cute,
        "flash_attn.cute.interface": interface,
    }


def fake_fa3(recorder: Recorder) -> dict[str, types.ModuleType]:
    """``vllm.vllm_flash_attn.flash_attn_interface``: writes into ``out``."""

    def flash_attn_varlen_func(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        max_seqlen_q: int,
        cu_seqlens_q: torch.Tensor,
        max_seqlen_k: int,
        cu_seqlens_k: torch.Tensor | None = None,
        seqused_k: torch.Tensor | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: list[int] | None = None,
        block_table: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        num_splits: int = 0,
        fa_version: int = 2,
        **rest: Any,
    ) -> torch.Tensor:
        recorder.calls.append(dict(locals()))
        _check_half(recorder, q, k, v)
        _check_int32(cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k, block_table=block_table)
        assert fa_version == 3 and seqused_k is not None and block_table is not None
        assert out is not None and out.shape == q.shape
        left = None if window_size is None or window_size[0] < 0 else window_size[0]
        paged_attention(
            q, k, v, cu_seqlens_q, cu_seqlens_q.diff().tolist(), seqused_k.tolist(), block_table,
            softmax_scale, causal, left, out,
        )  # fmt: skip
        return out

    interface = _module(
        "vllm.vllm_flash_attn.flash_attn_interface",
        FA3_AVAILABLE=True,
        FA3_UNAVAILABLE_REASON=None,
        flash_attn_varlen_func=flash_attn_varlen_func,
    )
    package = _module("vllm.vllm_flash_attn", flash_attn_interface=interface, __path__=[])
    return {
        "vllm": _module("vllm", vllm_flash_attn=package, __path__=[]),
        "vllm.vllm_flash_attn": package,
        "vllm.vllm_flash_attn.flash_attn_interface": interface,
    }


def fake_fa2(recorder: Recorder) -> dict[str, types.ModuleType]:
    """``flash_attn`` of flash-attn 2.x: varlen (with ``cu_seqlens_k``) and with_kvcache."""

    def flash_attn_varlen_func(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        block_table: torch.Tensor | None = None,
        **rest: Any,
    ) -> torch.Tensor:
        recorder.calls.append(dict(locals(), entry="varlen"))
        _check_half(recorder, q, k, v)
        _check_int32(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, block_table=block_table)
        assert block_table is not None and k.shape[1] % 256 == 0, "paged KV needs pages of 256n"
        out = torch.empty(q.shape, dtype=q.dtype)
        left = None if window_size[0] < 0 else window_size[0]
        paged_attention(
            q, k, v, cu_seqlens_q, cu_seqlens_q.diff().tolist(), cu_seqlens_k.diff().tolist(),
            block_table, softmax_scale, causal, left, out,
        )  # fmt: skip
        return out

    def flash_attn_with_kvcache(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cache_seqlens: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        num_splits: int = 0,
        **rest: Any,
    ) -> torch.Tensor:
        recorder.calls.append(dict(locals(), entry="kvcache"))
        _check_half(recorder, q, k_cache, v_cache)
        assert cache_seqlens is not None and block_table is not None
        assert q.dim() == 4 and k_cache.shape[1] % 256 == 0
        batch, seqlen_q = q.shape[:2]
        flat_q = q.reshape(batch * seqlen_q, *q.shape[2:])
        cu = torch.arange(0, batch * seqlen_q + 1, seqlen_q, dtype=torch.int32)
        out = torch.empty(flat_q.shape, dtype=q.dtype)
        left = None if window_size[0] < 0 else window_size[0]
        paged_attention(
            flat_q, k_cache, v_cache, cu, [seqlen_q] * batch, cache_seqlens.tolist(), block_table,
            softmax_scale, causal, left, out,
        )  # fmt: skip
        return out.view(q.shape)

    return {
        "flash_attn": _module(
            "flash_attn",
            flash_attn_varlen_func=flash_attn_varlen_func,
            flash_attn_with_kvcache=flash_attn_with_kvcache,
            __version__="2.8.3",
        )
    }


FAKES = {
    "FA4": (fake_fa4, fa4, "4.0.0b36"),
    "FA3": (fake_fa3, fa3, "0.25.1"),
    "FA2": (fake_fa2, fa2, "2.8.3"),
}


def install(
    monkeypatch: pytest.MonkeyPatch,
    providers: dict[str, str | None],
    recorder: Recorder | None = None,
) -> Recorder:
    """Make each named provider importable with the given distribution version (None: not
    installed), and forget earlier probes; every other provider stays as the environment has
    it (on CI: not installed). Returns the recorder the fakes share."""
    recorder = recorder or Recorder()
    monkeypatch.setattr(base, "_PROBES", {})
    monkeypatch.setenv(CACHE_ENABLED_VAR, "0")
    versions: dict[str, str | None] = {}
    for name, version in providers.items():
        make, module, _ = FAKES[name]
        library = getattr(module, f"{name}Kernel").library
        versions[library] = version
        if version is not None:
            for mod_name, mod in make(recorder).items():
                monkeypatch.setitem(sys.modules, mod_name, mod)
    real = base.dist_version

    def dist_version(distribution: str) -> str | None:
        return versions[distribution] if distribution in versions else real(distribution)

    for module in (base, fa2, fa3, fa4):
        monkeypatch.setattr(module, "dist_version", dist_version)
    return recorder
