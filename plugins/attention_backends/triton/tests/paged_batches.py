"""Random paged-attention steps for the TRITON_ATTN tests, a float64 reference, and the kernel
launches the tests make.

A batch has shuffled block tables, unwritten cache slots poisoned with NaN and outputs poisoned
with NaN, so a kernel that reads or leaves a slot it should not shows up as NaN. A batch with an
FP8 cache holds its context quantized as `pagellm.kv_cache.fp8.quantize_kv` does, and the
reference attends to the same quantized values, dequantized; its unwritten value slots hold
448, the largest finite value, instead of NaN (the kernels load value tiles unmasked, relying on
an FP8 cache never holding a NaN: `kernels.launch.values_token_minor`), so a kernel that gives
such a slot weight shows up as a wrong output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from pagellm.attention.backend import CommonAttentionMetadata
from pagellm.kv_cache.fp8 import FP8_KV_DTYPE, dequantize_kv, quantize_kv

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Tolerances against float64: the kernels round probabilities to the input dtype before P @ V.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


@dataclass
class Batch:
    """A step's inputs: the context before the step is already in the cache, the new tokens'
    K/V are in ``key``/``value``; every other cache slot holds NaN (448 in an FP8 cache's
    values)."""

    query: torch.Tensor  # [T, H, D], a strided view (as a slice of a fused QKV projection)
    key: torch.Tensor  # [T, Hkv, D]
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, Hkv, block_size, D]
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    keys: list[torch.Tensor]  # per row, the whole sequence's K [seq_len, Hkv, D], as cached
    values: list[torch.Tensor]
    query_lens: list[int]
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def num_tokens(self) -> int:
        return self.query.shape[0]

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def scales(self) -> tuple[float, float]:
        return self.k_scale, self.v_scale

    def common(self) -> CommonAttentionMetadata:
        return CommonAttentionMetadata(
            num_reqs=self.num_reqs,
            num_actual_tokens=self.num_tokens,
            max_query_len=max(self.query_lens),
            max_seq_len=int(self.seq_lens.max()),
            query_start_loc=self.query_start_loc,
            query_start_loc_cpu=self.query_start_loc.clone(),
            seq_lens=self.seq_lens,
            seq_lens_cpu=self.seq_lens.clone(),
            block_table=self.block_table,
            slot_mapping=self.slot_mapping,
        )


def cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value caches as the kernels take them (an FP8 cache's values token-minor)."""
    from pagellm_triton_attn.kernels.launch import split_kv_cache

    return split_kv_cache(kv_cache)


def make_batch(
    rows: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    block_size: int = 16,
    padding_rows: int = 0,
    seed: int = 0,
    fp8_scales: tuple[float, float] | None = None,
) -> Batch:
    """``rows`` are (cached context length, new tokens); ``padding_rows`` one-token rows follow
    with seq_len 0 and slot -1, as in a padded CUDA-graph batch. ``fp8_scales`` (k, v): the cache
    is float8_e4m3fn with these scales."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [ctx + new for ctx, new in rows] + [0] * padding_rows
    query_lens = [new for _, new in rows] + [1] * padding_rows
    blocks_per_row = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_row) + 5  # block 0 is the null block; a few spare ones
    shuffled = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_table = torch.zeros(len(seq_lens), max(max(blocks_per_row), 1), dtype=torch.int32)
    kv_cache = torch.full((2, num_blocks, num_kv_heads, block_size, head_size), float("nan"))
    kv_cache = kv_cache.to(FP8_KV_DTYPE if fp8_scales else dtype)
    if fp8_scales:
        kv_cache[1] = 448.0
    key_cache, value_cache = cache_views(kv_cache)
    k_scale, v_scale = fp8_scales or (1.0, 1.0)

    def as_cached(x: torch.Tensor, scale: float) -> torch.Tensor:
        return quantize_kv(x, scale) if fp8_scales else x

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    keys, values, new_k, new_v, slots = [], [], [], [], []
    for row, ((ctx, _), seq_len) in enumerate(zip(rows, seq_lens, strict=False)):
        n = blocks_per_row[row]
        block_table[row, :n] = torch.tensor(shuffled[:n], dtype=torch.int32)
        del shuffled[:n]
        k, v = rand(seq_len, num_kv_heads, head_size), rand(seq_len, num_kv_heads, head_size)
        if fp8_scales:  # large enough that some entries saturate at +-448 * scale
            k, v = (k.float() * 300 * k_scale).to(dtype), (v.float() * 300 * v_scale).to(dtype)
        cached_k, cached_v = as_cached(k, k_scale), as_cached(v, v_scale)
        if fp8_scales:
            keys.append(dequantize_kv(cached_k, k_scale, torch.float64))
            values.append(dequantize_kv(cached_v, v_scale, torch.float64))
        else:
            keys.append(k)
            values.append(v)
        for pos in range(seq_len):
            block, offset = int(block_table[row, pos // block_size]), pos % block_size
            if pos < ctx:
                key_cache[block, :, offset] = cached_k[pos]
                value_cache[block, :, offset] = cached_v[pos]
            else:
                slots.append(block * block_size + offset)
        new_k.append(k[ctx:])
        new_v.append(v[ctx:])
    for _ in range(padding_rows):
        new_k.append(rand(1, num_kv_heads, head_size))
        new_v.append(rand(1, num_kv_heads, head_size))
        slots.append(-1)
    num_tokens = sum(query_lens)
    # The query is a column slice of a wider tensor, as the output of a fused QKV projection.
    fused = rand(num_tokens, (num_heads + 2 * num_kv_heads) * head_size)
    query = fused[:, : num_heads * head_size].view(num_tokens, num_heads, head_size)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    return Batch(
        query=query,
        key=torch.cat(new_k),
        value=torch.cat(new_v),
        kv_cache=kv_cache,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        keys=keys + [None] * padding_rows,  # type: ignore[list-item]
        values=values + [None] * padding_rows,  # type: ignore[list-item]
        query_lens=query_lens,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def reference(batch: Batch, scale: float, window: int | None) -> torch.Tensor:
    """Float64 causal attention of each query token over its row's whole sequence; rows with
    no keys (padding) give zeros."""
    num_heads = batch.query.shape[1]
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    start = 0
    for row, q_len in enumerate(batch.query_lens):
        seq_len = int(batch.seq_lens[row])
        if seq_len > 0:
            group = num_heads // batch.keys[row].shape[1]
            k = batch.keys[row].double().repeat_interleave(group, dim=1)
            v = batch.values[row].double().repeat_interleave(group, dim=1)
            q = batch.query[start : start + q_len].double()
            scores = torch.einsum("qhd,khd->hqk", q, k) * scale
            q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
            k_pos = torch.arange(seq_len).unsqueeze(0)
            visible = k_pos <= q_pos
            if window is not None:
                visible &= k_pos > q_pos - window
            scores = scores.masked_fill(~visible, float("-inf"))
            out[start : start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        start += q_len
    return out


def assert_close_to_reference(out: torch.Tensor, batch: Batch, scale: float, window: int | None):
    assert torch.isfinite(out).all(), "some outputs were never written (still NaN)"
    expected = reference(batch, scale, window)
    tol = TOLERANCE[batch.query.dtype]
    if batch.kv_cache.dtype == FP8_KV_DTYPE:  # outputs scale with the values (up to 448 * v_scale)
        tol *= 300 * batch.v_scale
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def assert_new_kv_written(batch: Batch) -> None:
    """The new tokens' K/V sit at their slots bit for bit; padding slots wrote nothing."""
    block_size = batch.kv_cache.shape[3]
    live = batch.slot_mapping >= 0
    slots = batch.slot_mapping[live]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache, value_cache = cache_views(batch.kv_cache)
    stored_k = key_cache[blocks, :, offsets]
    stored_v = value_cache[blocks, :, offsets]
    expected_k, expected_v = batch.key[live], batch.value[live]
    if batch.kv_cache.dtype == FP8_KV_DTYPE:  # compare bits: rounding as quantize_kv's
        stored_k, stored_v = stored_k.view(torch.uint8), stored_v.view(torch.uint8)
        expected_k = quantize_kv(expected_k, batch.k_scale).view(torch.uint8)
        expected_v = quantize_kv(expected_v, batch.v_scale).view(torch.uint8)
    assert torch.equal(stored_k, expected_k)
    assert torch.equal(stored_v, expected_v)
    num_context = sum(int(s) for s in batch.seq_lens)
    written = (~batch.kv_cache[0, :, 0, :, 0].float().isnan()).sum()
    assert written == num_context, "a slot outside the batch's sequences was written"


def run_mixed(
    kernels: ModuleType,
    batch: Batch,
    scale: float,
    window: int | None,
    out: torch.Tensor | None = None,
    skip_decodes: bool = False,
) -> torch.Tensor:
    key_cache, value_cache = kernels.split_kv_cache(batch.kv_cache)
    kernels.write_kv_cache(
        batch.key, batch.value, key_cache, value_cache, batch.slot_mapping, *batch.scales
    )
    if out is None:
        out = torch.full(batch.query.shape, float("nan"), dtype=batch.query.dtype)
    kernels.paged_attention(
        batch.query,
        key_cache,
        value_cache,
        out,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_table,
        num_reqs=batch.num_reqs,
        num_tokens=batch.num_tokens,
        max_query_len=max(batch.query_lens),
        scale=scale,
        sliding_window=window,
        skip_decodes=skip_decodes,
        k_scale=batch.k_scale,
        v_scale=batch.v_scale,
    )
    return out


def run_decode(
    kernels: ModuleType,
    batch: Batch,
    scale: float,
    window: int | None,
    num_splits: int,
    out: torch.Tensor | None = None,
    row_order: torch.Tensor | None = None,
    tiles: Any = None,
) -> torch.Tensor:
    """``tiles``: a `launch.Tiles` other than the default (None)."""
    key_cache, value_cache = kernels.split_kv_cache(batch.kv_cache)
    kernels.write_kv_cache(
        batch.key, batch.value, key_cache, value_cache, batch.slot_mapping, *batch.scales
    )
    num_heads, head_size = batch.query.shape[1:]
    if out is None:
        out = torch.full(batch.query.shape, float("nan"), dtype=batch.query.dtype)
    scratch = None
    if num_splits > 1:
        scratch = kernels.split_scratch(
            batch.num_reqs, num_heads, head_size, num_splits, torch.device("cpu")
        )
        for buffer in scratch:
            buffer.fill_(float("nan"))
    kernels.paged_decode(
        batch.query,
        key_cache,
        value_cache,
        out,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_table,
        num_rows=batch.num_reqs,
        scale=scale,
        sliding_window=window,
        num_splits=num_splits,
        scratch=scratch,
        k_scale=batch.k_scale,
        v_scale=batch.v_scale,
        row_order=row_order,
        tiles=tiles,
    )
    return out
