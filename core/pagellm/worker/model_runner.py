"""The model runner: keeps the persistent batch in step with the scheduler, and runs each step as
named stages: update the batch, plan the step, prepare its inputs, run the forward pass (or replay
captured graphs: a decode step's whole, others' pieces around attention), sample one token for
each request whose scheduled tokens reach its end (or, for a pooling model, pool each prompt into
one vector: `_pool`), and report what was sampled. A multimodal model's steps that reach its
items' placeholder spans run on input embeddings with the items' rows in place
(`pagellm.worker.multimodal`), never as a graph.

A step is launched (`launch`: everything up to sampling queued on the device, the sampled ids'
copy to the host started) and collected (`collect`: those ids and logprobs on the host). Under
asynchronous scheduling the engine core launches step N+1 before it collects step N: the tokens
step N sampled then reach step N+1's input ids on the device, never through the host."""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import torch

from pagellm.attention.backend import CommonAttentionMetadata
from pagellm.attention.registry import attention_backends
from pagellm.config import EngineConfig
from pagellm.distributed import get_tp_group
from pagellm.forward_context import set_forward_context
from pagellm.kv_cache.manager import cdiv
from pagellm.kv_cache.spec import KVCacheSpec
from pagellm.layers.parallel_linear import kv_heads_per_rank
from pagellm.layers.sampler import (
    LogprobTensors,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    logprob_tensors,
)
from pagellm.platforms import current_platform
from pagellm.scheduler.output import (
    CachedRequestData,
    ModelRunnerOutput,
    SchedulerOutput,
)
from pagellm.worker.cudagraphs import CapturedGraph, DecodeGraphs
from pagellm.worker.input_batch import CachedRequestState, InputBatch
from pagellm.worker.multimodal import EncoderCache, MultiModalInputs, StepEmbeddings
from pagellm.worker.penalty_state import PenaltyState
from pagellm.worker.piecewise import PiecewiseGraphs
from pagellm.worker.sampling_metadata import SamplingMetadataBuilder
from pagellm.worker.step_buffers import StepBuffers
from pagellm.worker.step_inputs import StepPlan, plan_step, prepare_inputs
from pagellm.worker.step_results import StepInFlight

ENCODER_CACHE_STEPS = 2
"""The encoder cache holds the item embeddings of this many full steps' tokens."""


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.attn_backend = attention_backends.get(config.attention_backend)
        model_cfg = config.model
        block_size = config.cache.block_size
        self.block_size = block_size
        self.max_model_len = model_cfg.max_model_len
        self.kv_cache_spec = KVCacheSpec(
            block_size=block_size,
            # This rank's KV heads: the cache holds only those (all of them with one rank).
            num_kv_heads=kv_heads_per_rank(model_cfg.num_kv_heads, get_tp_group().world_size),
            head_size=model_cfg.head_size,
            dtype=model_cfg.torch_dtype,
            sliding_window=model_cfg.sliding_window,
            cache_dtype=config.cache.torch_cache_dtype(model_cfg.torch_dtype),
        )
        max_num_seqs = config.scheduler.max_num_seqs
        max_blocks_per_req = cdiv(self.max_model_len, block_size)
        self.input_batch = InputBatch(max_num_seqs, self.max_model_len, max_blocks_per_req)
        self.requests: dict[str, CachedRequestState] = {}
        pin = current_platform.is_pin_memory_available()
        self.penalty_state = PenaltyState(max_num_seqs, model_cfg.vocab_size, device, pin)
        self.input_batch.on_move = self.penalty_state.move_row
        self.sampling = SamplingMetadataBuilder(
            self.input_batch,
            self.requests,
            self.penalty_state,
            model_cfg.vocab_size,
            device,
            model_cfg.seed,
            pin_memory=pin,
        )
        self.sampler = Sampler()
        self.model: Any = None
        """Loaded by the worker (`Worker.load_model`)."""
        self.pooling = model_cfg.runner == "pooling"
        """Every step pools each of its (whole) prompts with the model's `Pooler`; none samples."""
        self.attn_builder = self.attn_backend.get_builder_cls()(self.kv_cache_spec, device)
        self.buffers = StepBuffers(
            config.scheduler.max_num_batched_tokens,
            max_num_seqs,
            max_blocks_per_req,
            device,
            pin_memory=pin,
        )
        self.graphs = DecodeGraphs(current_platform)
        self.piecewise = PiecewiseGraphs(current_platform)
        self.multimodal = (
            MultiModalInputs(
                EncoderCache(ENCODER_CACHE_STEPS * config.scheduler.max_num_batched_tokens),
                device,
            )
            if model_cfg.multimodal_specs
            else None
        )
        """The item embeddings of a multimodal model's steps (None for a text-only model)."""
        self.in_flight: deque[StepInFlight] = deque()
        """Steps launched and not collected yet (one at most between engine steps)."""
        self.num_launched = 0

    # ---------------------------------------------------------------- setup

    @torch.inference_mode()
    def capture_model(self) -> dict[str, float]:
        """Capture the graphs the config turns on (`DecodeGraphs`, then `PiecewiseGraphs`), all
        in one memory pool; returns the seconds each kind took."""
        comp = self.config.compilation
        seconds: dict[str, float] = {}
        if comp.cudagraph_mode == "none":
            return seconds
        pool = current_platform.graph_pool()
        if comp.cudagraph_capture_sizes:
            seconds["decode graphs"] = self.graphs.capture(
                self.model,
                self.attn_backend,
                self.attn_builder,
                self.buffers,
                comp.cudagraph_capture_sizes,
                self.max_model_len,
                pool,
            )
        if comp.piecewise_capture_sizes:
            seconds["piecewise graphs"] = self.piecewise.capture(
                self.model, self.buffers, comp.piecewise_capture_sizes, pool
            )
        return seconds

    # ---------------------------------------------------------------- the persistent batch

    def _update_states(self, out: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)
        for req_id in out.preempted_req_ids:
            # Keep its generated tokens: they are the batch row's, and it will come back.
            row = batch.req_id_to_index.get(req_id)
            if row is not None:
                state = self.requests[req_id]
                start = len(state.prompt_token_ids)
                state.output_token_ids = batch.token_ids[
                    row, start : batch.num_tokens[row]
                ].tolist()
            batch.remove_request(req_id)
        for new in out.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(params.seed)
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                sampling_params=params,
                generator=generator,
                eos_token_id=new.eos_token_id,
                output_token_ids=list(new.output_token_ids),
                mm_items=list(new.mm_items),
            )
            self.requests[new.req_id] = state
            self._add_to_batch(state, new.block_ids, new.num_computed_tokens)
        self._update_cached(out.scheduled_cached_reqs)

    def _update_cached(self, cached: CachedRequestData) -> None:
        """Requests resumed after preemption take a row again; then every cached row gets its
        progress, and new blocks where it crossed a block boundary."""
        resumed, new_block_ids = cached.resumed_from_preemption, cached.new_block_ids
        if True in resumed:
            for k in [k for k, r in enumerate(resumed) if r]:
                state = self.requests[cached.req_ids[k]]
                self._add_to_batch(state, new_block_ids[k], cached.num_computed_tokens[k])
        index_of = self.input_batch.req_id_to_index
        rows = [index_of[r] for r in cached.req_ids]
        self.input_batch.num_computed_tokens[rows] = cached.num_computed_tokens
        for k in [k for k, b in enumerate(new_block_ids) if b and not resumed[k]]:
            self.input_batch.append_block_ids(rows[k], new_block_ids[k])

    def _add_to_batch(
        self, state: CachedRequestState, block_ids: list[int], num_computed_tokens: int
    ) -> None:
        row = self.input_batch.add_request(state, block_ids, num_computed_tokens)
        if self.input_batch.has_penalties[row]:
            self.penalty_state.fill_row(row, state.prompt_token_ids, state.output_token_ids)

    def drop_requests(self, req_ids: list[str]) -> None:
        """Forget these requests entirely (after a failed step, whose partial updates cannot be
        trusted); the scheduler sends any of them that goes on as a new request."""
        for req_id in req_ids:
            self.requests.pop(req_id, None)
            self.input_batch.remove_request(req_id)
        self.in_flight.clear()  # a step that failed to finish leaves nothing to collect

    # ---------------------------------------------------------------- one step

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its results (synchronous scheduling)."""
        self.launch(out)
        return self.collect()

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> None:
        """Queue one step on the device and start its results' way to the host; `collect`
        returns them, possibly after the next step was launched. A token sampled by a step not
        collected yet reaches this step's inputs on the device (`_feed_pending_tokens`)."""
        self._update_states(out)
        self.num_launched += 1
        batch = self.input_batch
        if out.total_num_scheduled_tokens == 0:
            empty = np.zeros(0, dtype=np.int64)
            self.in_flight.append(StepInFlight(self.num_launched, [], empty, empty, empty, 0))
            return
        plan = plan_step(batch, out)
        embeds = None
        if self.multimodal is not None:
            embeds = self.multimodal.for_step(
                plan, batch, self.requests, self.model, self.config.model.torch_dtype
            )
        graph, piecewise = self._graphs_for(plan, embeds)
        common = self._prepare_inputs(plan, graph.size if graph is not None else plan.num_tokens)
        self._feed_pending_tokens(plan)
        if self.pooling:
            self.in_flight.append(self._pool(plan, self._forward(plan, common, graph)))
            return
        # Staged before the forward pass is queued, so that no copy waits for it.
        sampling = self.sampling.build(plan.sample_rows) if len(plan.sample_pos) else None
        sample_idx = None
        if len(plan.sample_pos) < plan.num_tokens:  # not every token samples: pick those that do
            sample_idx = self.buffers.to_device(plan.query_end[plan.sample_pos] - 1)
        hidden = self._forward(plan, common, graph, embeds, piecewise)
        rows = plan.sample_rows
        step = StepInFlight(
            self.num_launched,
            plan.req_ids,
            plan.sample_pos,
            rows,
            positions=batch.num_tokens[rows],  # a copy: `_sample` counts the new tokens
            batch_version=batch.version,
        )
        prompt_logprobs = self._prompt_logprobs(hidden, plan)
        to_host: list[torch.Tensor] = []
        if sampling is not None:
            sample_hidden = hidden if sample_idx is None else hidden.index_select(0, sample_idx)
            result = self._sample(plan, sample_hidden, sampling)
            step.sampled = result.sampled_token_ids
            to_host.append(result.sampled_token_ids)
            if result.logprobs is not None:
                to_host += result.logprobs.tensors()
                step.num_logprobs = batch.num_logprobs[rows]
        for lp in prompt_logprobs.values():
            to_host += lp.tensors()
        step.prompt_logprob_ids = list(prompt_logprobs)
        if to_host:
            step.host_copy = current_platform.copy_to_host(to_host)  # the step's one copy back
        self.in_flight.append(step)

    def collect(self) -> ModelRunnerOutput:
        """The results of the oldest step launched and not collected yet (waits for them)."""
        step = self.in_flight.popleft()
        return step.finish(self.input_batch, self.requests, self.max_model_len)

    def _graphs_for(
        self, plan: StepPlan, embeds: StepEmbeddings | None
    ) -> tuple[CapturedGraph | None, int | None]:
        """The decode graph that serves the step, else the piecewise size that does, else
        neither (eager). A step with item embeddings in its inputs always runs eagerly."""
        if embeds is not None:
            return None, None
        graph = self.graphs.for_step(len(plan.rows), plan.num_tokens)
        if graph is not None:
            return graph, None
        return None, self.piecewise.size_for(plan.num_tokens)

    def _prepare_inputs(self, plan: StepPlan, num_padded: int) -> CommonAttentionMetadata:
        return prepare_inputs(self.input_batch, self.buffers, plan, self.block_size, num_padded)

    def _feed_pending_tokens(self, plan: StepPlan) -> None:
        """Rows whose last token was sampled by the step still in flight: the host staged a stale
        id there, so copy the sampled id over it, on the device (each such row's query ends
        with that token)."""
        prev = self.in_flight[-1] if self.in_flight else None
        if prev is None or prev.sampled is None:
            return
        batch = self.input_batch
        pending = batch.pending_step[plan.rows] == prev.step_id
        if not pending.any():
            return
        to_device = self.buffers.to_device
        dst = to_device(plan.query_end[pending] - 1)
        src = to_device(batch.pending_index[plan.rows[pending]])
        self.buffers.device_tensors.input_ids.index_copy_(0, dst, prev.sampled[src])

    def _forward(
        self,
        plan: StepPlan,
        common: CommonAttentionMetadata,
        graph: CapturedGraph | None,
        embeds: StepEmbeddings | None = None,
        piecewise: int | None = None,
    ) -> torch.Tensor:
        """Replays a decode graph, or the piecewise graphs of size ``piecewise``, or runs eagerly."""
        if graph is not None:
            self.attn_builder.prepare_cudagraph_replay(graph.attn_metadata, common)
            graph.replay()
            return graph.hidden[: plan.num_tokens]
        if piecewise is not None:
            return self.piecewise.run(piecewise, plan.num_tokens, self.attn_builder.build(common))
        inputs, n = self.buffers.device_tensors, plan.num_tokens
        input_ids = inputs.input_ids[:n]
        inputs_embeds = None
        if embeds is not None:  # the items' rows in place of their placeholders' embeddings
            inputs_embeds = self.model.embed_input_ids(input_ids)
            inputs_embeds[embeds.index] = embeds.values.to(inputs_embeds.dtype)
        with set_forward_context(self.attn_builder.build(common)):
            if inputs_embeds is None:
                return self.model(input_ids, inputs.positions[:n])
            return self.model(input_ids, inputs.positions[:n], inputs_embeds)

    def _pool(self, plan: StepPlan, hidden: torch.Tensor) -> StepInFlight:
        """A pooling model's step: each row's prompt is whole in it (the engine runs pooling
        models without chunked prefill or prefix caching), so each is pooled now, and the pooled
        vectors start their way to the host."""
        batch, rows = self.input_batch, plan.rows
        if batch.num_computed_tokens[rows].any() or (plan.seq_lens != batch.num_tokens[rows]).any():
            raise RuntimeError(
                "A pooling step got a part of a prompt; pooling needs each prompt whole in one "
                "step (chunked prefill and prefix caching are off for pooling models)."
            )
        to_device = self.buffers.to_device
        pooled = self.model.pooler(
            hidden[: plan.num_tokens], to_device(plan.query_start), to_device(plan.query_lens)
        )
        empty = np.zeros(0, dtype=np.int64)
        step = StepInFlight(self.num_launched, plan.req_ids, empty, empty, empty, batch.version)
        step.pooled = True
        step.host_copy = current_platform.copy_to_host([pooled])
        return step

    def _sample(
        self, plan: StepPlan, hidden: torch.Tensor, sampling: SamplingMetadata
    ) -> SamplerOutput:
        """One token for each sampling row, counted in the row's length at once; its value
        reaches the row's token ids when the step is collected."""
        batch, rows = self.input_batch, plan.sample_rows
        result = self.sampler(self.model.compute_logits(hidden), sampling)
        penalized = batch.has_penalties[rows]
        if penalized.any():
            self.penalty_state.add_sampled(
                self.buffers.to_device(rows[penalized]),
                result.sampled_token_ids[self.buffers.to_device(np.flatnonzero(penalized))],
            )
        batch.num_tokens[rows] += 1
        batch.pending_step[rows] = self.num_launched
        batch.pending_index[rows] = np.arange(len(rows))
        return result

    def _prompt_logprobs(self, hidden: torch.Tensor, plan: StepPlan) -> dict[str, LogprobTensors]:
        """Logprobs of each prompt token given the tokens before it, for the prompt positions
        computed this step (only for requests that asked, each position once), on the device."""
        batch = self.input_batch
        wanted = np.flatnonzero(batch.num_prompt_logprobs[plan.rows] >= 0)
        result: dict[str, LogprobTensors] = {}
        if not len(wanted):
            return result
        query_start = plan.query_start
        for pos in wanted:
            row, state = plan.rows[pos], self.requests[plan.req_ids[pos]]
            start = int(batch.num_computed_tokens[row])
            # Position p predicts prompt token p + 1; skip positions already returned.
            first = max(start, state.num_prompt_logprobs_done)
            last = min(start + int(plan.query_lens[pos]), len(state.prompt_token_ids) - 1)
            if first >= last:
                continue
            offset = int(query_start[pos]) - start
            token_idx = torch.arange(first + offset, last + offset, device=self.device)
            logits = self.model.compute_logits(hidden[token_idx]).float()
            targets = self.buffers.to_device(
                np.asarray(state.prompt_token_ids[first + 1 : last + 1])
            )
            result[state.req_id] = logprob_tensors(
                logits.log_softmax(dim=-1), targets, int(batch.num_prompt_logprobs[row])
            )
            state.num_prompt_logprobs_done = last
        return result
