"""FA4: flash-attn-4's CuTe-DSL FlashAttention (``flash_attn.cute.flash_attn_varlen_func``).

Paged KV through ``page_table`` (int32 ``[rows, pages]``) over caches of ``[num_pages,
page_size, kv_heads, head_size]``, row lengths from ``seqused_k``, query rows from
``cu_seqlens_q``; ``seqused_q`` gives a row fewer query tokens than ``cu_seqlens_q`` spans, 0 to
skip it, which is how a mixed step leaves its decode rows to another kernel. Kernels are
JIT-compiled per variant on first call (3-6 s each), logged by `JitLog`.

Split-KV (``num_splits``) exists on sm_100 only: on sm_90 FA4 refuses it, so decode rows there
are never split. When a page holds a whole key tile, FA4 loads every row of a row's last page,
past ``seqused_k`` too (masked, but 0 x NaN is NaN): the cache must hold finite values, which
is why `FlashAttnBackend.allocate_kv_cache` zero-fills it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from packaging.version import Version

from pagellm.kv_cache.spec import KVCacheSpec
from pagellm_flash_attn.kernels.base import (
    AttentionKernel,
    KernelUnavailable,
    LayerParams,
    dist_version,
    sm_name,
)
from pagellm_flash_attn.kernels.fa4_setup import add_cutlass_dsl_packages, use_persistent_jit_cache
from pagellm_flash_attn.kernels.jit_log import JitLog

if TYPE_CHECKING:
    from pagellm_flash_attn.metadata import FlashAttnMetadata

MIN_VERSION = "4.0.0b36"
"""The release whose API this module was written against (and measured on the H200)."""


class FA4Kernel(AttentionKernel):
    name = "FA4"
    library = "flash-attn-4"
    leaves_decode_rows = True
    _jit_log: ClassVar[JitLog | None] = None
    """Shared by every FA4 kernel of the process, as FA4's compile caches are."""

    @classmethod
    def _import(cls) -> Any:
        version = dist_version(cls.library)
        if version is None:
            raise KernelUnavailable(
                "flash-attn-4 is not installed (pip install 'pagellm-flash-attn[fa4]')"
            )
        if Version(version) < Version(MIN_VERSION):
            raise KernelUnavailable(f"flash-attn-4 {version} is too old (needs >= {MIN_VERSION})")
        add_cutlass_dsl_packages()
        cache_dir = use_persistent_jit_cache()
        try:
            import flash_attn.cute
            from flash_attn.cute import interface
        except Exception as exc:  # the CuTe DSL raises RuntimeError for a missing CUDA flavour
            raise KernelUnavailable(
                f"flash-attn-4 {version} does not import ({type(exc).__name__}: {exc})"
            ) from exc
        cls._jit_log = JitLog(interface, cache_dir)
        return flash_attn.cute

    @classmethod
    def unsupported_gpu(cls, capability: tuple[int, int]) -> str | None:
        if capability[0] not in (9, 10):
            return f"FA4 runs on sm_90 and sm_100 (compute capability 9.x, 10.x), not {sm_name(capability)}"
        return None

    @classmethod
    def unsupported_shape(
        cls, capability: tuple[int, int], head_size: int, block_size: int
    ) -> list[str]:
        # Half-precision loads are 16 bytes: head sizes in multiples of 8 elements.
        if capability[0] == 9 and not (8 <= head_size <= 256 and head_size % 8 == 0):
            return [f"FA4 on sm_90 takes head sizes 8..256 in multiples of 8, not {head_size}"]
        if capability[0] == 10 and not (
            (8 <= head_size <= 128 and head_size % 8 == 0) or head_size == 256
        ):
            return [
                f"FA4 on sm_100 takes head sizes 8..128 in multiples of 8, and 256, not {head_size}"
            ]
        return []

    @classmethod
    def splits_kv(cls, capability: tuple[int, int]) -> bool:
        return capability[0] == 10

    def __init__(
        self, kv_cache_spec: KVCacheSpec, device: torch.device, capability: tuple[int, int]
    ) -> None:
        super().__init__(kv_cache_spec, device, capability)
        # 0: FA4's split heuristic; sm_90 has no split-KV and asserts on any other value than 1.
        self._decode_splits = 0 if self.splits_kv(capability) else 1

    def _attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: FlashAttnMetadata,
        layer: LayerParams,
        seqused_q: torch.Tensor | None,
        num_splits: int,
        what: str,
    ) -> torch.Tensor:
        log = self._jit_log
        entries, started = (log.entries(), time.perf_counter()) if log else (0, 0.0)
        out, _ = self.lib.flash_attn_varlen_func(
            query,
            key_cache,
            value_cache,
            cu_seqlens_q=meta.query_start_loc,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            seqused_q=seqused_q,
            seqused_k=meta.seq_lens,
            page_table=meta.block_table,
            softmax_scale=layer.scale,
            causal=True,
            window_size=(layer.window_left, 0 if layer.sliding_window else None),
            num_splits=num_splits,
        )
        if log is not None:
            log.after_call(entries, started, what)
        return out

    def prefill(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: FlashAttnMetadata,
        layer: LayerParams,
        seqused_q: torch.Tensor | None,
    ) -> torch.Tensor:
        what = f"a step of {meta.num_reqs} rows, up to {meta.max_query_len} query tokens"
        if seqused_q is not None:
            what += " (decode rows left to another kernel)"
        return self._attend(query, key_cache, value_cache, meta, layer, seqused_q, 1, what)

    def decode(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: FlashAttnMetadata,
        layer: LayerParams,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        what = f"a decode step of {meta.num_reqs} rows"
        out = self._attend(
            query, key_cache, value_cache, meta, layer, None, self._decode_splits, what
        )
        if meta.padded_slots:
            # A graph's padding rows (no keys) get zeros, as from every other kernel: FA4 gave
            # non-finite decode outputs at block size 128 on the H200, where it loads whole
            # pages by TMA, and rows without keys are the suspects (graph-safe: no host sync).
            out.masked_fill_((meta.seq_lens == 0)[:, None, None], 0.0)
        return out
