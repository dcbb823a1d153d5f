"""TRITON_ATTN: paged attention with this package's own Triton kernels.

Runs on CUDA GPUs; on CPU only under Triton's interpreter (``TRITON_INTERPRET=1``, read when this
module is imported), which is how the kernels are tested without a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from pagellm.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from pagellm.kv_cache.spec import KVCacheSpec

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_MIN_TRITON = (3, 2)
_MIN_FP8_CAPABILITY = (8, 9)


@dataclass
class SplitScratch:
    """Partial outputs and log-sum-exps of split-KV decode, shared by every layer of a step.

    Allocated on first use because their size depends on the number of query heads, which only
    the attention layers know."""

    num_rows: int
    num_splits: int
    device: torch.device
    buffers: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def get(self, num_heads: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        from pagellm_triton_attn.kernels import split_scratch

        key = (num_heads, head_size)
        if key not in self.buffers:
            self.buffers[key] = split_scratch(
                self.num_rows, num_heads, head_size, self.num_splits, self.device
            )
        return self.buffers[key]


@dataclass
class TritonAttentionMetadata:
    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    run_mixed_kernel: bool
    """`paged_attention` serves the rows of several query tokens, and the decode rows too unless
    `run_decode_kernel` is set."""
    run_decode_kernel: bool
    """`paged_decode` serves the rows of one query token."""
    num_splits: int = 1
    """Decode kernel: programs per (row, KV head), each over a share of the row's keys."""
    scratch: SplitScratch | None = None
    """Decode kernel with ``num_splits`` > 1: where the splits meet."""
    decode_order: torch.Tensor | None = None
    """Decode kernel: int32 [rows], the rows longest first, the order its programs take them
    (a persistent buffer, rewritten before each replay, in a captured graph)."""


def staged_row_order(common: CommonAttentionMetadata, device: torch.device) -> torch.Tensor:
    """`paged_decode`'s row order for this step (the rows longest first) on the host: in pinned
    memory for a GPU, so that the copy to the device does not wait for the step in flight
    (PyTorch's host allocator keeps the block until the copy has run)."""
    from pagellm_triton_attn.kernels import rows_longest_first

    host = torch.from_numpy(rows_longest_first(common.seq_lens_cpu.numpy()))
    return host if device.type == "cpu" else host.pin_memory()


class TritonAttentionMetadataBuilder(AttentionMetadataBuilder):
    programs_per_sm: ClassVar[int] = 4
    """A decode launch is split until it offers this many programs per SM (about four are
    resident at once with the default tiles)."""
    min_keys_per_split: ClassVar[int] = 256
    """Shorter shares are not worth a program and a merge."""
    min_decodes_for_decode_kernel: ClassVar[int] = 16
    """In a mixed batch, at least this many decode rows get the decode kernel (small tiles, four
    programs an SM) at the cost of a second launch; fewer ride along in the mixed kernel's
    tiles."""

    def __init__(self, kv_cache_spec: KVCacheSpec, device: torch.device) -> None:
        super().__init__(kv_cache_spec, device)
        if device.type == "cuda":
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        else:
            # The interpreter runs programs one after another: one "SM".
            num_sms = 1
        self.target_programs = self.programs_per_sm * num_sms
        # Captured graphs keep pointers into these: they live as long as the builder.
        self._graph_scratch: dict[tuple[int, int], SplitScratch] = {}

    def _num_splits(self, num_rows: int, max_seq_len: int) -> int:
        from pagellm_triton_attn.kernels import num_decode_splits

        return num_decode_splits(
            num_rows,
            self.kv_cache_spec.num_kv_heads,
            max_seq_len,
            self.target_programs,
            self.min_keys_per_split,
        )

    def build(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        # Decisions use host values only (the runner's integers and *_cpu tensors): no device
        # sync, and nothing here grows with context length.
        if common.max_query_len == 1:
            num_decodes, run_mixed = common.num_reqs, False
        else:
            qsl = common.query_start_loc_cpu
            num_decodes = int(((qsl[1:] - qsl[:-1]) == 1).sum())
            run_mixed = True
        run_decode = num_decodes > 0 and (
            not run_mixed or num_decodes >= self.min_decodes_for_decode_kernel
        )
        num_splits = self._num_splits(num_decodes, common.max_seq_len) if run_decode else 1
        scratch = None
        if num_splits > 1:
            scratch = SplitScratch(common.num_reqs, num_splits, self.device)
        order = None
        if run_decode and common.num_reqs > 1:
            order = staged_row_order(common, self.device).to(self.device, non_blocking=True)
        return TritonAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            num_reqs=common.num_reqs,
            max_query_len=common.max_query_len,
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table,
            slot_mapping=common.slot_mapping,
            run_mixed_kernel=run_mixed,
            run_decode_kernel=run_decode,
            num_splits=num_splits,
            scratch=scratch,
            decode_order=order,
        )

    def build_for_cudagraph(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        # The grid comes from the padded shapes and the capture-time worst case (max_seq_len is
        # max_model_len), never from this step's lengths: each split finds its keys from
        # seq_lens on the device at replay.
        num_rows = common.seq_lens.shape[0]
        num_splits = self._num_splits(num_rows, common.max_seq_len)
        scratch = None
        if num_splits > 1:
            scratch = self._graph_scratch.setdefault(
                (num_rows, num_splits), SplitScratch(num_rows, num_splits, self.device)
            )
        return TritonAttentionMetadata(
            num_actual_tokens=common.slot_mapping.shape[0],
            num_reqs=num_rows,
            max_query_len=1,
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table,
            slot_mapping=common.slot_mapping,
            run_mixed_kernel=False,
            run_decode_kernel=True,
            num_splits=num_splits,
            scratch=scratch,
            decode_order=torch.arange(num_rows, dtype=torch.int32, device=self.device),
        )

    def prepare_cudagraph_replay(
        self, attn_metadata: TritonAttentionMetadata, common: CommonAttentionMetadata
    ) -> None:
        # The padded rows (seq_len 0) sort last; the captured kernels read the buffer.
        assert attn_metadata.decode_order is not None
        attn_metadata.decode_order.copy_(staged_row_order(common, self.device), non_blocking=True)


class TritonAttentionImpl(AttentionImpl):
    writes_into_output = True

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None,
    ) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, sliding_window)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"TRITON_ATTN needs num_heads ({num_heads}) to be a multiple of num_kv_heads "
                f"({num_kv_heads})."
            )
        # Imported here, not at module level, so that `is_available` can explain a missing triton.
        from pagellm_triton_attn import kernels

        self._kernels = kernels

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TritonAttentionMetadata,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        meta = attn_metadata
        kernels = self._kernels
        n = meta.num_actual_tokens
        q = query[:n].view(n, self.num_heads, self.head_size)
        k = key[:n].view(n, self.num_kv_heads, self.head_size)
        v = value[:n].view(n, self.num_kv_heads, self.head_size)
        key_cache, value_cache = kernels.split_kv_cache(kv_cache)
        kernels.write_kv_cache(
            k, v, key_cache, value_cache, meta.slot_mapping, self.k_scale, self.v_scale
        )

        if output is not None:  # piecewise graphs' buffer: the kernels write the rows there
            out = output[:n].view(n, self.num_heads, self.head_size)
        else:
            out = torch.empty(
                n, self.num_heads, self.head_size, dtype=query.dtype, device=query.device
            )
        if meta.run_mixed_kernel:
            kernels.paged_attention(
                q,
                key_cache,
                value_cache,
                out,
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_table,
                num_reqs=meta.num_reqs,
                num_tokens=n,
                max_query_len=meta.max_query_len,
                scale=self.scale,
                sliding_window=self.sliding_window,
                skip_decodes=meta.run_decode_kernel,
                k_scale=self.k_scale,
                v_scale=self.v_scale,
            )
        if meta.run_decode_kernel:
            kernels.paged_decode(
                q,
                key_cache,
                value_cache,
                out,
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_table,
                num_rows=meta.num_reqs,
                scale=self.scale,
                sliding_window=self.sliding_window,
                num_splits=meta.num_splits,
                scratch=meta.scratch.get(self.num_heads, self.head_size) if meta.scratch else None,
                k_scale=self.k_scale,
                v_scale=self.v_scale,
                row_order=meta.decode_order,
            )
        return out.view(n, self.num_heads * self.head_size)


class TritonAttentionBackend(AttentionBackend):
    name = "TRITON_ATTN"
    supported_dtypes = (torch.float16, torch.bfloat16, torch.float32)
    # Any head size works (the kernels mask a power-of-two tile); these are the tested ones.
    supported_head_sizes = (16, 32, 64, 80, 96, 128, 256)
    block_size_multiple = 16
    default_block_size = 16
    supports_sliding_window = True
    supported_device_types = ("cuda", "cpu") if _INTERPRET else ("cuda",)
    # fp8_e4m3: quantized by the write kernel, dequantized inside the attention kernels.
    supported_kv_cache_dtypes = ("auto", "fp8_e4m3")
    cudagraph_support = True
    fp8_default_block_size = 64
    """An FP8 cache's block size when the user gives none. One page of one KV head is a
    contiguous ``block_size x head_size`` run of bytes, and the decode kernel reads longer runs
    faster: on an H200, W1's decode (200 rows of 768 keys, head 128) read its FP8 cache at
    2.59 TB/s in 16-slot pages (2 KiB runs), 3.09 in 32, 3.23 in 64; a bf16 cache 3.87 at each
    (`benchmarks/triton_decode_tiles.py --block-sizes 16 32 64`, docs/benchmarks.md)."""

    @classmethod
    def default_block_size_for(cls, kv_cache_dtype: str = "auto") -> int:
        return (
            cls.fp8_default_block_size if kv_cache_dtype == "fp8_e4m3" else cls.default_block_size
        )

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        # One block of one KV head is a contiguous block_size x head_size tile (an FP8 cache's
        # values are stored head_size x block_size: `kernels.split_kv_cache`).
        return (2, num_blocks, num_kv_heads, block_size, head_size)

    @staticmethod
    def allocate_kv_cache(
        shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        # The kernels never use a slot at or past a row's seq_len (loads there are masked, or
        # weighted 0), so unwritten memory, the null block included, is never used. An FP8
        # cache is zeroed: its value tiles are loaded unmasked and 0 * NaN would be NaN
        # (`kernels.launch.values_token_minor`).
        if dtype == torch.float8_e4m3fn:
            return torch.zeros(shape, dtype=dtype, device=device)
        return torch.empty(shape, dtype=dtype, device=device)

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return TritonAttentionMetadataBuilder

    @classmethod
    def is_available(cls) -> str | None:
        try:
            import triton
        except ImportError as exc:
            return f"triton is not importable ({exc}); pip install 'triton>=3.2,<3.10'"
        version = tuple(int(part) for part in triton.__version__.split(".")[:2])
        if version < _MIN_TRITON:
            return f"triton {triton.__version__} is too old (needs >= 3.2)"
        return None

    @classmethod
    def unsupported_reasons(
        cls,
        *,
        device_type: str,
        head_size: int,
        dtype: torch.dtype,
        block_size: int | None,
        sliding_window: int | None,
        kv_cache_dtype: str = "auto",
    ) -> list[str]:
        reasons = super().unsupported_reasons(
            device_type=device_type,
            head_size=head_size,
            dtype=dtype,
            block_size=block_size,
            sliding_window=sliding_window,
            kv_cache_dtype=kv_cache_dtype,
        )
        # Triton converts to and from e4m3 only on GPUs with FP8 (Ada, Hopper and later).
        if kv_cache_dtype == "fp8_e4m3" and device_type == "cuda" and torch.cuda.is_available():
            capability = torch.cuda.get_device_capability()
            if capability < _MIN_FP8_CAPABILITY:
                reasons.append(
                    f"kv cache dtype fp8_e4m3 needs compute capability >= 8.9 (this GPU has "
                    f"{capability[0]}.{capability[1]})"
                )
        return reasons
