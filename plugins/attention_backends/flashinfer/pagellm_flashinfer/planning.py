"""Planning FlashInfer's wrappers for a step: which kernels, and the calls that hand them the
step's paged batch.

A wrapper's ``plan`` takes the index arrays on the host (it schedules the work there and copies
its schedule to the device, non-blocking) and the attention hyperparameters; its ``run`` then
serves every layer of the step. Two wrappers do the work:

- prefill (``BatchPrefillWithPagedKVCacheWrapper``, causal): the rows of more than one query
  token, prompts and chunks after cached context. A mixed step's leading decode rows (the
  scheduler puts the running requests first) go to the decode wrapper, in a second launch per
  layer; decode rows after the first longer row stay in the prefill wrapper's batch (the model
  runner does not sort rows). On Hopper it runs FlashInfer's FA3 kernels, elsewhere FA2.
- decode (``BatchDecodeWithPagedKVCacheWrapper`` with tensor cores, FA2): decode-only steps and
  mixed steps' leading decode rows, run eagerly, or replayed from a CUDA graph (one wrapper per
  captured batch size, whose index buffers have fixed addresses).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from pagellm.kv_cache.spec import KVCacheSpec
from pagellm_flashinfer.paged_kv import PagedKVIndex

KV_LAYOUT = "NHD"
"""Each page of K (and of V) is [block_size, num_kv_heads, head_size]."""
FA3_MIN_CUDA = (12, 3)
"""FlashInfer builds its sm_90a (FA3) kernels with CUDA 12.3 or later."""


@dataclass(frozen=True)
class LayerParams:
    """What every attention layer of the model must share for one plan to serve them all (the
    metadata builder does not know them: the first layer to run in a step plans with its own)."""

    num_qo_heads: int
    sm_scale: float
    window_left: int
    """Keys at most this many positions before the query are visible; -1: all of them."""


def window_left(sliding_window: int | None) -> int:
    """pagellm's window ``w`` (a query sees itself and the ``w - 1`` positions before it) as
    FlashInfer's ``window_left``."""
    return -1 if sliding_window is None else sliding_window - 1


def prefill_backend(capability: tuple[int, int] | None, cuda_version: str | None) -> str:
    """``"fa3"`` on Hopper (sm_90) with CUDA >= 12.3, else ``"fa2"``."""
    if capability is None or capability[0] != 9 or cuda_version is None:
        return "fa2"
    major, minor = (int(part) for part in cuda_version.split(".")[:2])
    return "fa3" if (major, minor) >= FA3_MIN_CUDA else "fa2"


def plan_prefill(wrapper: Any, index: PagedKVIndex, params: LayerParams, spec: KVCacheSpec) -> None:
    wrapper.plan(
        index.qo_indptr,
        index.kv_indptr,
        index.kv_indices,
        index.kv_last_page_len,
        params.num_qo_heads,
        spec.num_kv_heads,
        spec.head_size,
        spec.block_size,
        causal=True,
        sm_scale=params.sm_scale,
        window_left=params.window_left,
        q_data_type=spec.dtype,
        kv_data_type=spec.dtype,
        non_blocking=True,
        # Known here: spares plan a Python loop over the rows.
        max_token_per_sequence=index.max_query_len,
        # Pinned: plan's copy of the rows' lengths to the device does not wait for it.
        seq_lens=index.seq_lens,
    )


def plan_decode(
    wrapper: Any,
    index: PagedKVIndex,
    params: LayerParams,
    spec: KVCacheSpec,
    disable_split_kv: bool = False,
) -> None:
    wrapper.plan(
        index.kv_indptr,
        index.kv_indices,
        index.kv_last_page_len,
        params.num_qo_heads,
        spec.num_kv_heads,
        spec.head_size,
        spec.block_size,
        pos_encoding_mode="NONE",
        window_left=params.window_left,
        q_data_type=spec.dtype,
        kv_data_type=spec.dtype,
        sm_scale=params.sm_scale,
        non_blocking=True,
        disable_split_kv=disable_split_kv,
    )


@dataclass
class GraphDecode:
    """The decode wrapper of one captured batch size and the device buffers its graph reads
    (views of storage the metadata builder keeps, shared by every size: only one graph replays
    at a time, and each replay is planned right before it)."""

    wrapper: Any
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    replans: bool = True
    """Rescheduled before each replay (split-KV on). Otherwise planned once with split-KV off:
    FlashInfer's schedule then has one work unit per row and KV head whatever the lengths,
    which the kernel reads from the index buffers, so a replay only needs those rewritten. For
    batches with enough rows to fill the GPU without splitting (`FlashInferMetadataBuilder.
    graph_split_kv_below_ctas`)."""
    planned: bool = False


def plan_graph_decode(
    flashinfer: ModuleType,
    graph: GraphDecode,
    index: PagedKVIndex,
    params: LayerParams,
    spec: KVCacheSpec,
) -> None:
    """The first plan (before capture) is the wrapper's own, which loads the kernels and
    copies the arrays into the graph's buffers. Before each replay, the builder has written
    ``kv_indptr`` into its buffer; the other arrays are written into theirs here and, for a
    graph that `replans`, ``flashinfer.fast_decode_plan`` reschedules: FlashInfer's replanning
    for this case, which unlike ``plan`` runs no Python loop over the rows (``plan`` finds the
    longest row for backends other than FA2)."""
    if not graph.planned:
        plan_decode(graph.wrapper, index, params, spec, disable_split_kv=not graph.replans)
        graph.planned = True
        return
    num_pages = index.kv_indices.shape[0]
    # graph.kv_indptr was written when the index was made (the page gather reads it there).
    graph.kv_last_page_len.copy_(index.kv_last_page_len, non_blocking=True)
    graph.kv_indices[:num_pages].copy_(index.kv_indices)
    if not graph.replans:
        return
    flashinfer.fast_decode_plan(
        graph.wrapper,
        index.kv_indptr,
        index.kv_indices,
        index.kv_last_page_len,
        params.num_qo_heads,
        spec.num_kv_heads,
        spec.head_size,
        spec.block_size,
        pos_encoding_mode="NONE",
        window_left=params.window_left,
        q_data_type=spec.dtype,
        kv_data_type=spec.dtype,
        sm_scale=params.sm_scale,
        non_blocking=True,
    )
