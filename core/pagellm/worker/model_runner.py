"""The model runner: keeps the persistent batch in step with the scheduler, lays out each step's
inputs (token ids, positions, slot mapping, block tables), runs the forward pass in the forward
context and samples one token for each request whose scheduled tokens reach its end."""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from pagellm.attention.backend import CommonAttentionMetadata
from pagellm.attention.registry import get_backend_cls
from pagellm.config import EngineConfig
from pagellm.forward_context import set_forward_context
from pagellm.kv_cache.manager import cdiv
from pagellm.kv_cache.spec import KVCacheSpec
from pagellm.layers.sampler import Penalties, Sampler, SamplingMetadata, gather_logprobs
from pagellm.model_loader import load_model
from pagellm.platforms import current_platform
from pagellm.scheduler.output import ModelRunnerOutput, SampleLogprobs, SchedulerOutput
from pagellm.worker.input_batch import CachedRequestState, InputBatch
from pagellm.worker.penalty_state import PenaltyState
from pagellm.worker.step_buffers import StepBuffers

logger = logging.getLogger(__name__)


@dataclass
class CapturedGraph:
    """A decode step of ``size`` rows captured once: replaying it re-runs the forward pass on
    whatever the persistent buffers hold, writing into ``hidden``."""

    size: int
    graph: Any  # torch.cuda.CUDAGraph
    hidden: torch.Tensor
    attn_metadata: Any


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.attn_backend = get_backend_cls(config.attention_backend)
        model_cfg = config.model
        block_size = config.cache.block_size
        self.block_size = block_size
        self.max_model_len = model_cfg.max_model_len
        self.kv_cache_spec = KVCacheSpec(
            block_size=block_size,
            num_kv_heads=model_cfg.num_kv_heads,
            head_size=model_cfg.head_size,
            dtype=model_cfg.torch_dtype,
            sliding_window=model_cfg.sliding_window,
        )
        self.input_batch = InputBatch(
            config.scheduler.max_num_seqs, self.max_model_len, cdiv(self.max_model_len, block_size)
        )
        self.requests: dict[str, CachedRequestState] = {}
        self.penalty_state = PenaltyState(
            config.scheduler.max_num_seqs, model_cfg.vocab_size, device
        )
        self.input_batch.on_move = self.penalty_state.move_row
        self.sampler = Sampler()
        self.default_generator = torch.Generator(device=device).manual_seed(model_cfg.seed)
        self.model: Any = None
        self.kv_caches: list[torch.Tensor] = []
        self.attn_builder = self.attn_backend.get_builder_cls()(self.kv_cache_spec, device)
        self.buffers = StepBuffers(
            config.scheduler.max_num_batched_tokens,
            config.scheduler.max_num_seqs,
            cdiv(self.max_model_len, block_size),
            device,
            pin_memory=current_platform.is_pin_memory_available(),
        )
        self.cudagraph_sizes: list[int] = []
        self._md_cache: tuple[tuple[int, bytes], SamplingMetadata] | None = None
        self.cudagraphs: dict[int, CapturedGraph] = {}

    # ---------------------------------------------------------------- setup

    def load_model(self) -> None:
        self.model = load_model(self.config, self.attn_backend, self.device)

    def model_memory_bytes(self) -> int:
        assert self.model is not None
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def decode_weight_bytes(self) -> int:
        """Weight bytes one decode step reads: every parameter, except an untied input embedding
        table (only a few of its rows are read)."""
        assert self.model is not None
        total = self.model_memory_bytes()
        embed = getattr(getattr(self.model, "model", None), "embed_tokens", None)
        lm_head = getattr(self.model, "lm_head", None)
        if embed is not None and lm_head is not embed:
            total -= sum(p.numel() * p.element_size() for p in embed.parameters())
        return total

    @torch.inference_mode()
    def profile_run(self) -> None:
        """One forward pass over ``max_num_batched_tokens`` tokens and a sampling step over
        ``max_num_seqs`` rows, before the KV cache exists, so the platform can measure peak
        activation memory (attention itself is skipped)."""
        assert self.model is not None
        sched = self.config.scheduler
        n = sched.max_num_batched_tokens
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        positions = torch.arange(n, device=self.device) % self.max_model_len
        with set_forward_context(None):
            hidden = self.model(ids, positions)
        logits = self.model.compute_logits(hidden[: min(sched.max_num_seqs, n)])
        logits.float().log_softmax(dim=-1).argmax(dim=-1)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        from pagellm.attention.layer import Attention

        assert self.model is not None
        spec = self.kv_cache_spec
        shape = self.attn_backend.get_kv_cache_shape(
            num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size
        )
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.kv_caches = [
            self.attn_backend.allocate_kv_cache(shape, spec.dtype, self.device) for _ in layers
        ]
        for layer, cache in zip(layers, self.kv_caches, strict=True):
            layer.kv_cache = cache

    @torch.inference_mode()
    def capture_model(self) -> None:
        """Capture one CUDA graph per configured decode batch size (largest first, sharing one
        memory pool). Does nothing unless the platform turned CUDA graphs on."""
        comp = self.config.compilation
        if comp.cudagraph_mode != "decode" or not comp.cudagraph_capture_sizes:
            return
        if not self.attn_backend.cudagraph_support:
            raise ValueError(
                f"Attention backend {self.attn_backend.name} does not support CUDA graphs; "
                "pass --enforce-eager."
            )
        assert self.model is not None
        sizes = sorted(s for s in comp.cudagraph_capture_sizes if s <= self.buffers.max_reqs)
        started = time.perf_counter()
        buf, h = self.buffers, self.buffers.host
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(sizes):
            # Every row is padding (seq_len 0, slot -1): capture reads no KV cache.
            h.input_ids[:size] = 0
            h.positions[:size] = 0
            h.slot_mapping[:size] = -1
            h.query_start_loc[: size + 1] = np.arange(size + 1)
            h.seq_lens[:size] = 0
            buf.copy_to_device(size, size, 0)
            d = buf.device_tensors
            common = CommonAttentionMetadata(
                num_reqs=size,
                num_actual_tokens=size,
                max_query_len=1,
                max_seq_len=self.max_model_len,
                query_start_loc=d.query_start_loc[: size + 1],
                query_start_loc_cpu=buf.host_tensors.query_start_loc[: size + 1],
                seq_lens=d.seq_lens[:size],
                seq_lens_cpu=buf.host_tensors.seq_lens[:size],
                block_table=d.block_table[:size],
                slot_mapping=d.slot_mapping[:size],
            )
            meta = self.attn_builder.build_for_cudagraph(common)
            with set_forward_context(meta):
                for _ in range(2):  # warm-up: kernels compiled and autotuned outside capture
                    self.model(buf.input_ids[:size], buf.positions[:size])
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = self.model(buf.input_ids[:size], buf.positions[:size])
            self.cudagraphs[size] = CapturedGraph(size, graph, hidden, meta)
        torch.cuda.synchronize()
        self.cudagraph_sizes = sizes
        logger.info(
            "Captured %d CUDA graphs (decode batch sizes %d..%d) in %.1f s",
            len(sizes),
            sizes[0],
            sizes[-1],
            time.perf_counter() - started,
        )

    # ---------------------------------------------------------------- one step

    def _update_states(self, out: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)
        for req_id in out.preempted_req_ids:
            # Keep its generated tokens: they are the batch row's, and it will come back.
            index = batch.req_id_to_index.get(req_id)
            if index is not None:
                state = self.requests[req_id]
                start = len(state.prompt_token_ids)
                state.output_token_ids = batch.token_ids[
                    index, start : batch.num_tokens[index]
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
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                eos_token_id=new.eos_token_id,
                output_token_ids=list(new.output_token_ids),
            )
            self.requests[new.req_id] = state
            self._add_to_batch(state)
        cached = out.scheduled_cached_reqs
        if not cached.req_ids:
            return
        if True not in cached.resumed_from_preemption:
            # The common case, vectorised: progress for every row, new blocks for the few that
            # crossed a block boundary. (A state's own num_computed_tokens is only read when it
            # is re-admitted, and then the scheduler sends it.)
            index_of = batch.req_id_to_index
            rows = [index_of[r] for r in cached.req_ids]
            batch.num_computed_tokens[rows] = cached.num_computed_tokens
            new_block_ids = cached.new_block_ids
            for k in [k for k, b in enumerate(new_block_ids) if b]:
                self.requests[cached.req_ids[k]].block_ids.extend(new_block_ids[k])
                batch.append_block_ids(rows[k], new_block_ids[k])
            return
        for req_id, resumed, block_ids, num_computed in zip(
            cached.req_ids,
            cached.resumed_from_preemption,
            cached.new_block_ids,
            cached.num_computed_tokens,
            strict=True,
        ):
            state = self.requests[req_id]
            state.num_computed_tokens = num_computed
            if resumed:
                state.block_ids = list(block_ids)
                self._add_to_batch(state)
                continue
            state.block_ids.extend(block_ids)
            index = batch.req_id_to_index[req_id]
            batch.num_computed_tokens[index] = num_computed
            if block_ids:
                batch.append_block_ids(index, block_ids)

    def drop_requests(self, req_ids: list[str]) -> None:
        """Forget these requests entirely (after a failed step, whose partial updates cannot be
        trusted); the scheduler sends any of them that goes on as a new request."""
        for req_id in req_ids:
            self.requests.pop(req_id, None)
            self.input_batch.remove_request(req_id)
        self._md_cache = None

    def _add_to_batch(self, state: CachedRequestState) -> None:
        row = self.input_batch.add_request(state)
        if self.input_batch.has_penalties[row]:
            self.penalty_state.fill_row(row, state.prompt_token_ids, state.output_token_ids)

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(out)
        if out.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        assert self.model is not None
        batch = self.input_batch

        # Scheduled rows in batch order, and their token counts.
        num_reqs = len(out.num_scheduled_tokens)
        if num_reqs == batch.num_reqs:
            rows = np.arange(num_reqs)  # everyone runs: rows are already contiguous and ordered
        else:
            rows = np.array(
                sorted(batch.req_id_to_index[r] for r in out.num_scheduled_tokens), dtype=np.int64
            )
        req_ids = cast(list[str], [batch.req_ids[i] for i in rows])
        sched = out.num_scheduled_tokens
        num_sched = np.fromiter((sched[r] for r in req_ids), dtype=np.int64, count=num_reqs)
        total = out.total_num_scheduled_tokens
        cu = np.cumsum(num_sched)
        seq_lens = batch.num_computed_tokens[rows] + num_sched

        graph = None
        if total == num_reqs and self.cudagraph_sizes and num_reqs <= self.cudagraph_sizes[-1]:
            size = self.cudagraph_sizes[bisect.bisect_left(self.cudagraph_sizes, num_reqs)]
            graph = self.cudagraphs[size]
        padded = graph.size if graph is not None else total
        common = self._prepare_inputs(rows, num_sched, cu, seq_lens, padded)
        buf = self.buffers
        # Sample only for requests whose scheduled tokens reach their last token. The sampling
        # parameters are staged before the forward pass is queued, so no copy waits for it.
        sample_pos = np.flatnonzero(seq_lens >= batch.num_tokens[rows])
        sample_rows = rows[sample_pos]
        decode_only = len(sample_pos) == total
        sample_ids = req_ids if decode_only else [req_ids[p] for p in sample_pos]
        sampling_md = self._sampling_metadata(sample_rows, sample_ids) if len(sample_pos) else None
        sample_idx = buf.to_device(cu[sample_pos] - 1) if not decode_only else None
        if graph is not None:
            graph.graph.replay()
            hidden = graph.hidden[:total]
        else:
            attn_metadata = self.attn_builder.build(common)
            with set_forward_context(attn_metadata):
                hidden = self.model(buf.input_ids[:total], buf.positions[:total])

        prompt_logprobs = self._prompt_logprobs(hidden, rows, req_ids, num_sched, cu - num_sched)

        logprob_lists: list[SampleLogprobs | None] = [None] * len(rows)
        if sampling_md is None:
            sampled_lists: list[list[int]] = [[] for _ in rows]
        else:
            sample_hidden = hidden if sample_idx is None else hidden.index_select(0, sample_idx)
            logits = self.model.compute_logits(sample_hidden)
            result = self.sampler(logits, sampling_md)
            penalized = batch.has_penalties[sample_rows]
            if penalized.any():
                self.penalty_state.add_sampled(
                    buf.to_device(sample_rows[penalized]),
                    result.sampled_token_ids[buf.to_device(np.flatnonzero(penalized))],
                )
            tokens = result.sampled_token_ids.tolist()  # the step's one device→host copy
            n_tok = batch.num_tokens[sample_rows]
            fits = n_tok < self.max_model_len
            batch.token_ids[sample_rows[fits], n_tok[fits]] = np.asarray(tokens)[fits]
            batch.num_tokens[sample_rows] = n_tok + 1
            if decode_only:
                sampled_lists = [[token] for token in tokens]
            else:
                sampled_lists = [[] for _ in rows]
                for pos, token in zip(sample_pos.tolist(), tokens, strict=True):
                    sampled_lists[pos] = [token]
            if result.logprobs is not None:
                for j, (p, row) in enumerate(zip(sample_pos.tolist(), sample_rows, strict=True)):
                    if batch.num_logprobs[row] < 0:
                        continue
                    lp = result.logprobs[j]
                    k = int(batch.num_logprobs[row]) + 1
                    lp.token_ids, lp.logprobs = lp.token_ids[:k], lp.logprobs[:k]
                    logprob_lists[p] = lp
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled_lists,
            logprobs=logprob_lists if any(lp is not None for lp in logprob_lists) else None,
            prompt_logprobs=prompt_logprobs,
        )

    def _prepare_inputs(
        self,
        rows: np.ndarray,
        num_sched: np.ndarray,
        cu: np.ndarray,
        seq_lens: np.ndarray,
        padded: int,
    ) -> CommonAttentionMetadata:
        """Lay the step's inputs out in the host staging buffers, copy them to the device buffers
        (non-blocking from pinned memory) and describe them. ``padded`` > the token count only for
        a CUDA-graph replay: padding rows get one token, ``seq_len`` 0 and slot -1."""
        batch, buf, bs = self.input_batch, self.buffers, self.block_size
        num_reqs, total = len(rows), int(cu[-1])
        h = buf.host
        if total == num_reqs:  # decode-only: one token per row, no repeats needed
            positions = batch.num_computed_tokens[rows]
            row_of_token = rows
        else:
            row_of_token = np.repeat(rows, num_sched)
            positions = batch.num_computed_tokens[row_of_token] + (
                np.arange(total) - np.repeat(cu - num_sched, num_sched)
            )
        h.positions[:total] = positions
        h.input_ids[:total] = batch.token_ids[row_of_token, positions]
        h.slot_mapping[:total] = batch.block_table[row_of_token, positions // bs] * bs + (
            positions % bs
        )
        h.query_start_loc[0] = 0
        h.query_start_loc[1 : num_reqs + 1] = cu
        h.seq_lens[:num_reqs] = seq_lens
        num_rows = num_reqs
        if padded > total:
            h.input_ids[total:padded] = 0
            h.positions[total:padded] = 0
            h.slot_mapping[total:padded] = -1
            h.query_start_loc[num_reqs + 1 : padded + 1] = np.arange(total + 1, padded + 1)
            h.seq_lens[num_reqs:padded] = 0
            num_rows = padded
        max_seq_len = int(seq_lens.max())
        max_blocks = cdiv(max_seq_len, bs)
        if num_reqs == batch.num_reqs and rows[0] == 0:
            h.block_table[:num_reqs, :max_blocks] = batch.block_table[:num_reqs, :max_blocks]
        else:
            h.block_table[:num_reqs, :max_blocks] = batch.block_table[rows, :max_blocks]
        buf.copy_to_device(padded, num_rows, max_blocks)
        d = buf.device_tensors
        return CommonAttentionMetadata(
            num_reqs=num_rows,
            num_actual_tokens=padded,
            max_query_len=int(num_sched.max()),
            max_seq_len=max_seq_len,
            query_start_loc=d.query_start_loc[: num_rows + 1],
            query_start_loc_cpu=buf.host_tensors.query_start_loc[: num_rows + 1],
            seq_lens=d.seq_lens[:num_rows],
            seq_lens_cpu=buf.host_tensors.seq_lens[:num_rows],
            block_table=d.block_table[:num_rows, :max_blocks],
            slot_mapping=d.slot_mapping[:padded],
        )

    def _prompt_logprobs(
        self,
        hidden: torch.Tensor,
        rows: np.ndarray,
        req_ids: list[str],
        num_sched: np.ndarray,
        query_start_loc: np.ndarray,
    ) -> dict[str, list[SampleLogprobs]] | None:
        """Logprobs of each prompt token given the tokens before it, for the prompt positions
        computed this step (only for requests that asked, each position once)."""
        batch = self.input_batch
        wanted = np.flatnonzero(batch.num_prompt_logprobs[rows] >= 0)
        if not len(wanted):
            return None
        result: dict[str, list[SampleLogprobs]] = {}
        for pos in wanted:
            row, state = rows[pos], self.requests[req_ids[pos]]
            start = int(batch.num_computed_tokens[row])
            # Position p predicts prompt token p + 1; skip positions already returned.
            first = max(start, state.num_prompt_logprobs_done)
            last = min(start + int(num_sched[pos]), len(state.prompt_token_ids) - 1)
            if first >= last:
                continue
            token_idx = torch.arange(first - start, last - start) + int(query_start_loc[pos])
            logits = self.model.compute_logits(hidden[token_idx.to(self.device)]).float()
            targets = torch.tensor(state.prompt_token_ids[first + 1 : last + 1], device=self.device)
            result[state.req_id] = gather_logprobs(
                logits.log_softmax(dim=-1), targets, int(batch.num_prompt_logprobs[row])
            )
            state.num_prompt_logprobs_done = last
        return result or None

    def _sampling_metadata(self, rows: np.ndarray, req_ids: list[str]) -> SamplingMetadata:
        batch = self.input_batch
        # The per-row parameters only change when the batch does: reuse them (and their device
        # copies) until a request joins or leaves or other rows sample.
        key = (batch.version, rows.tobytes())
        if self._md_cache is None or self._md_cache[0] != key:
            self._md_cache = (key, self._base_sampling_metadata(rows))
        md = self._md_cache[1]
        penalties = self._penalties(rows)
        sparse = np.flatnonzero(batch.has_sparse_params[rows])
        if penalties is None and not len(sparse):
            return md
        md = dataclasses.replace(md, penalties=penalties)
        if len(sparse):
            self._add_sparse_params(md, sparse, rows[sparse], [req_ids[j] for j in sparse])
        return md

    def _base_sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        batch = self.input_batch
        dev = self.device
        temperature = batch.temperature[rows]
        top_p = batch.top_p[rows]
        top_k = batch.top_k[rows]
        min_p = batch.min_p[rows]
        num_logprobs = batch.num_logprobs[rows]
        vocab = self.config.model.vocab_size
        generators = {
            j: batch.generators[int(r)] for j, r in enumerate(rows) if int(r) in batch.generators
        }
        return SamplingMetadata(
            temperature=torch.from_numpy(temperature).to(dev),
            all_greedy=bool((temperature == 0).all()),
            all_random=bool((temperature > 0).all()),
            top_p=torch.from_numpy(top_p).to(dev) if (top_p < 1).any() else None,
            top_k=torch.from_numpy(np.where(top_k > 0, np.minimum(top_k, vocab), vocab)).to(dev)
            if (top_k > 0).any()
            else None,
            min_p=torch.from_numpy(min_p).to(dev) if (min_p > 0).any() else None,
            generators=generators,
            default_generator=self.default_generator,
            max_num_logprobs=int(num_logprobs.max()) if (num_logprobs >= 0).any() else None,
        )

    def _penalties(self, rows: np.ndarray) -> Penalties | None:
        batch = self.input_batch
        if not batch.has_penalties[rows].any():
            return None
        repetition = batch.repetition_penalty[rows]
        dev = self.device
        counts, prompt_mask = self.penalty_state.gather(
            self.buffers.to_device(rows), with_prompt_mask=bool((repetition != 1).any())
        )
        return Penalties(
            presence=torch.from_numpy(batch.presence_penalty[rows]).to(dev),
            frequency=torch.from_numpy(batch.frequency_penalty[rows]).to(dev),
            repetition=torch.from_numpy(repetition).to(dev),
            output_counts=counts,
            prompt_mask=prompt_mask,
        )

    def _add_sparse_params(
        self, md: SamplingMetadata, positions: np.ndarray, rows: np.ndarray, req_ids: list[str]
    ) -> None:
        """Logit bias, allowed tokens, bad words and min_tokens: per-row lists, rare enough to
        gather in Python for the rows that use them."""
        vocab = self.config.model.vocab_size
        bias_rows: list[int] = []
        bias_tokens: list[int] = []
        bias_values: list[float] = []
        ban_rows: list[int] = []
        ban_tokens: list[int] = []
        allowed: torch.Tensor | None = None
        num_rows = md.temperature.shape[0]
        batch = self.input_batch
        for j, row, req_id in zip(positions.tolist(), rows.tolist(), req_ids, strict=True):
            state = self.requests[req_id]
            params = state.sampling_params
            # Only the output's length and its last few tokens matter: nothing here grows with it.
            n_prompt, n = int(batch.num_prompt_tokens[row]), int(batch.num_tokens[row])
            output_len = n - n_prompt
            if params.logit_bias:
                bias_rows += [j] * len(params.logit_bias)
                bias_tokens += list(params.logit_bias)
                bias_values += list(params.logit_bias.values())
            if params.allowed_token_ids:
                if allowed is None:
                    allowed = torch.ones(num_rows, vocab, dtype=torch.bool)
                allowed[j] = False
                allowed[j, params.allowed_token_ids] = True
            for seq in params.bad_words_token_ids or ():
                prefix = seq[:-1]
                if not prefix or (
                    output_len >= len(prefix)
                    and batch.token_ids[row, n - len(prefix) : n].tolist() == prefix
                ):
                    ban_rows.append(j)
                    ban_tokens.append(seq[-1])
            if output_len < params.min_tokens:
                stops = list(params.stop_token_ids or ())
                if state.eos_token_id is not None:
                    stops.append(state.eos_token_id)
                ban_rows += [j] * len(stops)
                ban_tokens += stops
        dev = self.device
        if bias_rows:
            md.logit_bias = (
                torch.tensor(bias_rows, device=dev),
                torch.tensor(bias_tokens, device=dev),
                torch.tensor(bias_values, dtype=torch.float32, device=dev),
            )
        if ban_rows:
            keep = [i for i, t in enumerate(ban_tokens) if t < vocab]
            md.banned = (
                torch.tensor([ban_rows[i] for i in keep], device=dev, dtype=torch.long),
                torch.tensor([ban_tokens[i] for i in keep], device=dev, dtype=torch.long),
            )
        if allowed is not None:
            md.allowed_mask = allowed.to(dev)
