"""FLASHINFER's per-step metadata: the paged batch in FlashInfer's arrays, and the wrapper that
serves the step, planned once for all layers.

The builder knows the KV cache but not the layers' query heads and softmax scale, which
``plan`` needs: the first layer to run in a step plans with its own (`FlashInferMetadata.
ensure_planned`), the other layers check theirs are the same. A captured graph's metadata is
planned by the forward passes run before its capture, then again before every replay
(`prepare_cudagraph_replay`), with the layer parameters of the first plan.

Host arrays live in pinned buffers that every plan's copies read from; before they are
rewritten, the builder waits for the copies issued by the previous plan (recorded by an event,
normally long done), which also covers the pinned buffers FlashInfer's wrappers reuse.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from pagellm.attention.backend import AttentionMetadataBuilder, CommonAttentionMetadata
from pagellm.kv_cache.spec import KVCacheSpec
from pagellm_flashinfer.host_max import shadow_max
from pagellm_flashinfer.jit_cache import compile_missing, modules_for
from pagellm_flashinfer.paged_kv import (
    PagedKVIndex,
    fill_page_counts,
    gather_page_indices,
    leading_decode_rows,
)
from pagellm_flashinfer.planning import (
    KV_LAYOUT,
    GraphDecode,
    LayerParams,
    plan_decode,
    plan_graph_decode,
    plan_prefill,
    prefill_backend,
)
from pagellm_flashinfer.replay import PrefillRun
from pagellm_flashinfer.triton_decode import TritonDecode, triton_decode_runner


@dataclass
class StepPart:
    """A run of the step's rows, served by one wrapper: tokens ``start:end`` of the step."""

    start: int
    end: int
    index: PagedKVIndex | None
    """These rows' arrays, their indptrs starting at 0 (as FlashInfer reads them); None for
    TRITON_ATTN's decode kernel (`triton_decode`), which reads the block table."""
    wrapper: Any
    plan: Callable[[StepPart, LayerParams], None]
    call: PrefillRun | None = None
    """The prefill wrapper's run for this step's layers (`replay`), made when it is planned;
    None for the other wrappers, whose ``run`` each layer calls."""

    @property
    def arrays(self) -> PagedKVIndex:
        """The index of a part a FlashInfer wrapper serves."""
        assert self.index is not None, "TRITON_ATTN's decode part has no FlashInfer arrays"
        return self.index


@dataclass
class FlashInferMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    index: PagedKVIndex | None
    """The whole step's arrays; None when no FlashInfer wrapper serves the step."""
    parts: list[StepPart]
    """One part for a step of decode rows (an eager decode wrapper, or a captured graph's) or
    of prompt rows; two for a mixed step whose leading rows decode: those rows on the decode
    wrapper, the rest on the prefill one."""
    pads_with_null_slots: bool = False
    """A captured graph's batch: padding tokens have slot -1, which the layers write to the null
    block's first slot (no row reads the null block)."""
    planned_with: LayerParams | None = None

    @property
    def decode_only(self) -> bool:
        return all(part.index is None or part.index.max_query_len == 1 for part in self.parts)

    @property
    def wrapper(self) -> Any:
        """The wrapper of a one-part step."""
        (part,) = self.parts
        return part.wrapper

    def ensure_planned(self, params: LayerParams) -> None:
        if self.planned_with is None:
            for part in self.parts:
                part.plan(part, params)
            self.planned_with = params
        elif params != self.planned_with:
            raise ValueError(
                f"FLASHINFER plans one step for all attention layers, which must share their "
                f"query heads, softmax scale and window: {params} differs from {self.planned_with}"
            )


class _HostArrays:
    """Staging for one step's ``qo_indptr``, ``kv_indptr``, ``kv_last_page_len`` and
    ``seq_lens``, grown to the largest batch seen."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.rows = 0
        self._allocate(16)

    def _allocate(self, rows: int) -> None:
        def empty(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, pin_memory=self.pin)

        self.rows = rows
        self.qo_indptr, self.kv_indptr = empty(rows + 1), empty(rows + 1)
        self.kv_last_page_len, self.seq_lens = empty(rows), empty(rows)

    def views(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if rows > self.rows:
            self._allocate(max(rows, 2 * self.rows))
        return (
            self.qo_indptr[: rows + 1],
            self.kv_indptr[: rows + 1],
            self.kv_last_page_len[:rows],
            self.seq_lens[:rows],
        )


@dataclass
class _GraphStorage:
    """The device index buffers of every captured graph (each takes views)."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor


class FlashInferMetadataBuilder(AttentionMetadataBuilder):
    workspace_bytes: ClassVar[int] = 256 << 20
    """FlashInfer's float workspace (split-KV partial outputs), shared by every wrapper: their
    runs follow one another on one stream."""
    graph_split_kv_below_ctas: ClassVar[int] = 4
    """A captured batch of rows x KV heads under this many work units per SM keeps split-KV and
    is rescheduled before each replay (few rows, possibly long); a larger one fills the GPU
    unsplit and is planned once (`GraphDecode.replans`): no host scheduling before its replays."""
    graph_int_workspace_bytes: ClassVar[int] = 1 << 20
    """The schedule buffer shared by the graphs' decode wrappers that are rescheduled right
    before each replay (`GraphDecode.replans`); a schedule of 512 rows takes tens of KB."""
    graph_own_schedule_bytes: ClassVar[int] = 256 << 10
    """The schedule buffer of each graph planned once: FlashInfer keeps a plan's schedule (work
    units, chunk size) in the wrapper's int workspace, where its kernel reads it at every
    replay, so a graph that is not rescheduled must not share it with any other wrapper."""

    def __init__(self, kv_cache_spec: KVCacheSpec, device: torch.device) -> None:
        super().__init__(kv_cache_spec, device)
        # Imported here, not at module level, so that selection can explain a missing library.
        import flashinfer

        self._flashinfer = flashinfer
        shadow_max(flashinfer)  # plan()'s longest row in one op, not a loop over the rows
        capability = None
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            capability = (major, minor)
        self.prefill_backend = prefill_backend(capability, torch.version.cuda)
        spec = kv_cache_spec
        self._triton = triton_decode_runner(kv_cache_spec, device)
        compile_missing(
            flashinfer,
            modules_for(
                self.prefill_backend,
                spec.dtype,
                spec.head_size,
                spec.sliding_window is not None,
                decode_wrapper=self._triton is None,
            ),
        )
        # Allocated here, before the profiling run, so that the KV cache sizing counts them.
        self._workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, KV_LAYOUT, backend=self.prefill_backend
        )
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, KV_LAYOUT, use_tensor_cores=True
        )
        on_gpu = device.type == "cuda"
        self._host = _HostArrays(pin=on_gpu)
        self._num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else 132
        )
        self._tail_host = _HostArrays(pin=on_gpu)  # a mixed step's prompt rows, rebased
        self._kv_indptr = torch.zeros(self._host.rows + 1, dtype=torch.int32, device=device)
        self._copies_done = torch.cuda.Event() if on_gpu else None
        self._graphs: dict[int, GraphDecode] = {}
        self._graph_storage: _GraphStorage | None = None
        self._graph_int_workspace: torch.Tensor | None = None

    # ------------------------------------------------------------------ eager steps

    def build(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        if self._kv_indptr.shape[0] < common.num_reqs + 1:
            self._kv_indptr = torch.zeros(
                max(common.num_reqs, 2 * self._kv_indptr.shape[0]) + 1,
                dtype=torch.int32,
                device=self.device,
            )
        num_tokens = common.num_actual_tokens
        if self._triton is not None and common.max_query_len == 1:
            part = self._triton_part(common, num_tokens, common.num_reqs, for_graph=False)
            return FlashInferMetadata(num_tokens, common.slot_mapping, None, [part])
        index = self._index(common, self._kv_indptr[: common.num_reqs + 1])
        if common.max_query_len == 1:
            parts = [StepPart(0, num_tokens, index, self._decode, self._plan_decode)]
        else:
            num_decodes = leading_decode_rows(index.qo_indptr.numpy())
            if num_decodes == 0:
                parts = [StepPart(0, num_tokens, index, self._prefill, self._plan_prefill)]
            else:
                decodes, prompts = self._split(index, num_decodes)
                parts = [
                    StepPart(0, num_decodes, decodes, self._decode, self._plan_decode),
                    StepPart(num_decodes, num_tokens, prompts, self._prefill, self._plan_prefill),
                ]
                if self._triton is not None:  # after the prompts: every one-token row
                    qsl = common.query_start_loc_cpu
                    ones = int(((qsl[1:] - qsl[:-1]) == 1).sum())
                    parts = [parts[1], self._triton_part(common, num_tokens, ones, False)]
        return FlashInferMetadata(
            num_actual_tokens=num_tokens,
            slot_mapping=common.slot_mapping,
            index=index,
            parts=parts,
        )

    def _triton_part(
        self, common: CommonAttentionMetadata, num_tokens: int, num_decodes: int, for_graph: bool
    ) -> StepPart:
        wrapper = TritonDecode(self._triton, common, num_decodes, for_graph)
        return StepPart(0, num_tokens, None, wrapper, TritonDecode.set_params)

    def _index(self, common: CommonAttentionMetadata, kv_indptr: torch.Tensor) -> PagedKVIndex:
        """The step's arrays; ``kv_indptr`` is the device buffer the page gather reads."""
        if self._copies_done is not None:
            self._copies_done.synchronize()
        qo_indptr, kv_indptr_host, last_page_len, seq_lens = self._host.views(common.num_reqs)
        qo_indptr.copy_(common.query_start_loc_cpu)
        seq_lens.copy_(common.seq_lens_cpu)
        num_pages = fill_page_counts(
            common.seq_lens_cpu.numpy(),
            self.kv_cache_spec.block_size,
            kv_indptr_host.numpy(),
            last_page_len.numpy(),
        )
        kv_indptr.copy_(kv_indptr_host, non_blocking=True)
        kv_indices = gather_page_indices(common.block_table, kv_indptr, num_pages)
        self._issued_copies()
        return PagedKVIndex(
            qo_indptr, kv_indptr_host, last_page_len, kv_indices, common.max_query_len, seq_lens
        )

    def _split(self, index: PagedKVIndex, num_decodes: int) -> tuple[PagedKVIndex, PagedKVIndex]:
        """The step's first ``num_decodes`` rows (one query token each) and the others, each
        with its own arrays: the first are views, the others rebased to start at 0 in a second
        set of host buffers (written after the wait of `_index`)."""
        d = num_decodes
        pages_before = int(index.kv_indptr[d])
        decodes = PagedKVIndex(
            index.qo_indptr[: d + 1],
            index.kv_indptr[: d + 1],
            index.kv_last_page_len[:d],
            index.kv_indices[:pages_before],
            1,
            index.seq_lens[:d],
        )
        rows = index.num_rows - d
        qo_indptr, kv_indptr, last_page_len, seq_lens = self._tail_host.views(rows)
        torch.sub(index.qo_indptr[d:], d, out=qo_indptr)
        torch.sub(index.kv_indptr[d:], pages_before, out=kv_indptr)
        last_page_len.copy_(index.kv_last_page_len[d:])
        seq_lens.copy_(index.seq_lens[d:])
        prompts = PagedKVIndex(
            qo_indptr,
            kv_indptr,
            last_page_len,
            index.kv_indices[pages_before:],
            index.max_query_len,
            seq_lens,
        )
        return decodes, prompts

    def _issued_copies(self) -> None:
        if self._copies_done is not None:
            self._copies_done.record()

    def _plan_prefill(self, part: StepPart, params: LayerParams) -> None:
        plan_prefill(part.wrapper, part.arrays, params, self.kv_cache_spec)
        part.call = PrefillRun(part.wrapper)
        self._issued_copies()

    def _plan_decode(self, part: StepPart, params: LayerParams) -> None:
        plan_decode(part.wrapper, part.arrays, params, self.kv_cache_spec)
        self._issued_copies()

    # ------------------------------------------------------------------ CUDA graphs

    def build_for_cudagraph(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        num_rows = common.seq_lens.shape[0]
        num_tokens = common.slot_mapping.shape[0]
        if self._triton is not None:
            part = self._triton_part(common, num_tokens, num_rows, for_graph=True)
            return FlashInferMetadata(num_tokens, common.slot_mapping, None, [part], True)
        graph = self._graph(num_rows, num_rows * common.block_table.shape[1])
        index = self._index(common, graph.kv_indptr)
        plan = functools.partial(self._plan_graph, graph)
        return FlashInferMetadata(
            num_actual_tokens=num_tokens,
            slot_mapping=common.slot_mapping,
            index=index,
            parts=[StepPart(0, num_tokens, index, graph.wrapper, plan)],
            pads_with_null_slots=True,
        )

    def prepare_cudagraph_replay(
        self, attn_metadata: FlashInferMetadata, common: CommonAttentionMetadata
    ) -> None:
        meta = attn_metadata
        if meta.planned_with is None:
            raise RuntimeError("FLASHINFER: a graph was captured before any layer planned it")
        (part,) = meta.parts
        if isinstance(part.wrapper, TritonDecode):
            part.wrapper.prepare_replay(common)
            return
        assert meta.index is not None
        graph = self._graphs[meta.index.num_rows]
        meta.index = part.index = self._index(common, graph.kv_indptr)
        part.plan(part, meta.planned_with)

    def _plan_graph(self, graph: GraphDecode, part: StepPart, params: LayerParams) -> None:
        plan_graph_decode(self._flashinfer, graph, part.arrays, params, self.kv_cache_spec)
        self._issued_copies()

    def _graph(self, num_rows: int, max_pages: int) -> GraphDecode:
        if num_rows in self._graphs:
            return self._graphs[num_rows]
        storage = self._graph_storage
        if (
            storage is None
            or storage.kv_last_page_len.shape[0] < num_rows
            or storage.kv_indices.shape[0] < max_pages
        ):
            # Captures go largest first, so this normally happens once; graphs captured before
            # keep the storage they took views of.
            def zeros(n: int) -> torch.Tensor:
                return torch.zeros(n, dtype=torch.int32, device=self.device)

            storage = _GraphStorage(zeros(num_rows + 1), zeros(max_pages), zeros(num_rows))
            self._graph_storage = storage
        work_units = num_rows * self.kv_cache_spec.num_kv_heads
        replans = work_units < self.graph_split_kv_below_ctas * self._num_sms
        if replans:
            if self._graph_int_workspace is None:
                self._graph_int_workspace = torch.zeros(
                    self.graph_int_workspace_bytes, dtype=torch.uint8, device=self.device
                )
            schedule = self._graph_int_workspace
        else:
            schedule = torch.zeros(
                self.graph_own_schedule_bytes, dtype=torch.uint8, device=self.device
            )
        graph = GraphDecode(
            replans=replans,
            wrapper=self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                KV_LAYOUT,
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=storage.kv_indptr[: num_rows + 1],
                paged_kv_indices_buffer=storage.kv_indices[:max_pages],
                paged_kv_last_page_len_buffer=storage.kv_last_page_len[:num_rows],
            ),
            kv_indptr=storage.kv_indptr[: num_rows + 1],
            kv_indices=storage.kv_indices[:max_pages],
            kv_last_page_len=storage.kv_last_page_len[:num_rows],
        )
        graph.wrapper.reset_workspace_buffer(self._workspace, schedule)
        self._graphs[num_rows] = graph
        return graph
