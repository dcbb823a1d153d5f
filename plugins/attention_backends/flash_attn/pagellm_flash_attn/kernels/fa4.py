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

FA4's entry point is several hundred lines of Python per call (argument checks, the tile and
scheduler choice, a compile key of some 70 fields) before it launches its compiled kernel: about
0.4 ms of host time on the H200's host, more than the kernel takes in most steps. Every
attention layer of a step makes the same call but for its query, caches and output, so only the
first layer's goes through the entry point; `_KernelRecorder` notes which compiled kernel it
launched with which arguments, and the step's other layers launch that kernel directly with
their own tensors in those four places (`_Replays`). The recorded arguments are checked against
the call's own tensors first; where they do not match (another FA4 release laying them out
otherwise), every call goes through the entry point, as before.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
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

logger = logging.getLogger(__name__)

MIN_VERSION = "4.0.0b36"
"""The release whose API this module was written against (and measured on the H200)."""

# Where FA4's forward kernel takes the tensors that differ between the layers of a step
# (flash_attn.cute.interface._flash_attn_fwd, 4.0.0b36): q, k, v, out, then lse, the scale, the
# step's arrays and options, which every layer of the step shares.
_Q, _K, _V, _OUT = range(4)


class _KernelRecorder:
    """Stands in for FA4's compile cache of forward kernels: hands out its kernels as the cache
    does, and keeps the last one launched with its arguments."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.last: tuple[Any, tuple[Any, ...]] | None = None

    def __contains__(self, key: Any) -> bool:
        return key in self.inner

    def __setitem__(self, key: Any, kernel: Any) -> None:
        self.inner[key] = kernel

    def __getitem__(self, key: Any) -> Any:
        kernel = self.inner[key]

        def launch(*args: Any) -> Any:
            self.last = (kernel, args)
            return kernel(*args)

        return launch

    def __getattr__(self, name: str) -> Any:  # the cache's own attributes (`cache`, `clear`)
        return getattr(self.inner, name)


def _recorder(interface: Any) -> _KernelRecorder | None:
    """Put a `_KernelRecorder` in front of FA4's forward compile cache (once per process)."""
    forward = getattr(interface, "_flash_attn_fwd", None)
    cache = getattr(forward, "compile_cache", None)
    if forward is None or cache is None:
        return None
    if not isinstance(cache, _KernelRecorder):
        cache = _KernelRecorder(cache)
        forward.compile_cache = cache
    return cache


@dataclass
class _Replays:
    """The kernels a step's first layers launched, with their arguments, per variant of the
    call (layers of other windows or heads in one model make other variants)."""

    meta: Any
    """The step's `FlashAttnMetadata` (the same object for every layer of the step)."""
    launches: dict[tuple[Any, ...], tuple[Any, tuple[Any, ...]]]


class FA4Kernel(AttentionKernel):
    name = "FA4"
    library = "flash-attn-4"
    leaves_decode_rows = True
    _jit_log: ClassVar[JitLog | None] = None
    """Shared by every FA4 kernel of the process, as FA4's compile caches are."""
    _kernels: ClassVar[_KernelRecorder | None] = None
    reads_strided_query: ClassVar[bool] = True
    """Whether FA4 reads an aligned, non-contiguous query in place (4.0.0b36 does); turned off
    when a launch shows it copied one."""
    replays_layers: ClassVar[bool] = True
    """Whether a step's later layers launch the kernel its first layer's call chose (off: every
    layer goes through FA4's entry point; an A/B switch)."""

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
        cls._kernels = _recorder(interface)
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
        self._replays = _Replays(None, {})
        self.entry_calls = 0
        """Calls through FA4's entry point (the others launched a recorded kernel)."""

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
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The call's output: ``out`` where the kernel is replayed (given an output tensor),
        else FA4's own (its entry point takes none)."""
        # FA4 reads q in place where its layout is aligned (the model's q, a column slice of
        # the fused q/k/v projection, is); else it would copy q itself, and a copy made here
        # keeps the replayed launches' arguments the caller's.
        if not (_aligned_layout(query) and (self.reads_strided_query or query.is_contiguous())):
            query = query.contiguous()
        # A split launch adds a combine after the kernel: only single launches are replayed.
        replayable = num_splits == 1 and self.replays_layers and self._kernels is not None
        variant = (
            layer, seqused_q is not None, query.shape, query.dtype, key_cache.shape,
            value_cache.shape, key_cache.stride(), query.stride(),
        )  # fmt: skip
        if self._replays.meta is not meta:
            self._replays = _Replays(meta, {})
        launch = self._replays.launches.get(variant) if replayable else None
        if launch is not None:
            kernel, recorded = launch
            if out is None:
                out = torch.empty(
                    *query.shape[:2], value_cache.shape[-1], dtype=query.dtype, device=query.device
                )
            args = list(recorded)
            args[_Q], args[_K], args[_V], args[_OUT] = query, key_cache, value_cache, out
            kernel(*args)
            return out
        self.entry_calls += 1
        kernels = self._kernels
        if kernels is not None:
            kernels.last = None
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
        if replayable and kernels is not None and kernels.last is not None:
            kernel, launched = kernels.last
            if _launched_with(launched, query, key_cache, value_cache, out):
                self._replays.launches[variant] = (kernel, launched)
            elif not query.is_contiguous() and _launched_with(
                launched, query, key_cache, value_cache, out, skip=(_Q,)
            ):
                # This FA4 copied the strided query itself: from now on a copy is made here,
                # which the replays then take the place of.
                type(self).reads_strided_query = False
            else:
                logger.warning(
                    "FLASH_ATTN: FA4 %s launches its kernel with arguments laid out otherwise "
                    "than 4.0.0b36 does; every layer goes through its entry point",
                    self.version(),
                )
                type(self).replays_layers = False
        return out

    def prefill(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: FlashAttnMetadata,
        layer: LayerParams,
        seqused_q: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        what = f"a step of {meta.num_reqs} rows, up to {meta.max_query_len} query tokens"
        if seqused_q is not None:
            what += " (decode rows left to another kernel)"
        return self._attend(query, key_cache, value_cache, meta, layer, seqused_q, 1, what, out)

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
            query, key_cache, value_cache, meta, layer, None, self._decode_splits, what, out
        )
        if meta.padded_slots:
            # A graph's padding rows (no keys) get zeros, as from every other kernel: FA4 gave
            # non-finite decode outputs at block size 128 on the H200, where it loads whole
            # pages by TMA, and rows without keys are the suspects (graph-safe: no host sync).
            out.masked_fill_((meta.seq_lens == 0)[:, None, None], 0.0)
        return out


def _aligned_layout(tensor: torch.Tensor) -> bool:
    """Whether FA4 takes ``tensor`` without a copy (flash_attn.cute's `maybe_contiguous`, 16-byte
    alignment): its last dimension contiguous, its pointer and its other strides in bytes
    multiples of 16."""
    size = tensor.element_size()
    return (
        tensor.stride(-1) == 1
        and tensor.data_ptr() % 16 == 0
        and all(stride * size % 16 == 0 for stride in tensor.stride()[:-1])
    )


def _launched_with(
    args: tuple[Any, ...],
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    skip: tuple[int, ...] = (),
) -> bool:
    """Whether FA4 launched its kernel with this call's query, caches and output in the places
    a replay puts another layer's (but for the places in ``skip``)."""
    if len(args) <= _OUT:
        return False
    expected = {_Q: query, _K: key_cache, _V: value_cache, _OUT: out}
    for index, tensor in expected.items():
        if index in skip:
            continue
        arg = args[index]
        if not (
            isinstance(arg, torch.Tensor)
            and arg.data_ptr() == tensor.data_ptr()
            and arg.shape == tensor.shape
            and arg.stride() == tensor.stride()
        ):
            return False
    return True
