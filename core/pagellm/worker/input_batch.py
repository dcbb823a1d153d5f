"""The persistent batch: one row per running request, kept between steps and updated in place.

Rows hold token ids, progress, block tables and sampling parameters as numpy arrays so each
step's inputs are built with vectorized indexing, not per-token Python. Rows stay contiguous
(``condense`` fills holes left by removed requests with rows from the end).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pagellm.multimodal.inputs import MultiModalItem
from pagellm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """What the worker keeps per request, across preemptions, until the request finishes."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    """The scheduler's tuple (no list: a running request's prompt stays out of the garbage
    collector's full collections)."""
    sampling_params: SamplingParams
    generator: torch.Generator | None
    eos_token_id: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    """Tokens generated before the last preemption (while running, they live in the batch row)."""
    num_prompt_logprobs_done: int = 0
    """Prompt positions whose logprobs were already returned (kept across preemption)."""
    mm_items: list[MultiModalItem] = field(default_factory=list)
    """The prompt's multimodal items (kept across preemption: a recompute embeds them again)."""


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        self.has_sparse_params = np.zeros(max_num_reqs, dtype=bool)
        """Rows whose parameters need per-row work (logit bias, allowed ids, bad words, min tokens)."""
        self.generators: dict[int, torch.Generator] = {}
        self.has_penalties = np.zeros(max_num_reqs, dtype=bool)
        self.pending_step = np.full(max_num_reqs, -1, dtype=np.int64)
        """The launched step (`ModelRunner.num_launched`) that sampled the row's last token,
        whose value the host may not have yet (`ModelRunner._feed_pending_tokens`)."""
        self.pending_index = np.zeros(max_num_reqs, dtype=np.int64)
        """Where that token sits among the step's sampled ids."""
        self.version = 0
        """Bumped whenever a row changes request (add, remove, condense)."""
        self.on_move: Callable[[int, int], None] | None = None
        """Told (src, dst) when condensing moves a request to another row."""
        # What condensing moves row by row: every per-row array (token ids apart: only a row's
        # used prefix is copied).
        self._arrays = [
            v for v in vars(self).values() if isinstance(v, np.ndarray) and v is not self.token_ids
        ]

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(
        self, state: CachedRequestState, block_ids: list[int], num_computed_tokens: int
    ) -> int:
        """Put the request (new, or resumed after preemption) in the first free row; returns
        the row."""
        self.version += 1
        index = self.num_reqs  # rows are contiguous, so the first free one is at the end
        self.req_ids[index] = state.req_id
        self.req_id_to_index[state.req_id] = index
        prompt_len = len(state.prompt_token_ids)
        num_tokens = prompt_len + len(state.output_token_ids)
        self.token_ids[index, :prompt_len] = state.prompt_token_ids
        self.token_ids[index, prompt_len:num_tokens] = state.output_token_ids
        self.num_tokens[index] = num_tokens
        self.num_computed_tokens[index] = num_computed_tokens
        self.pending_step[index] = -1  # every token it comes with is known
        self.block_table[index, : len(block_ids)] = block_ids
        self.block_table[index, len(block_ids) :] = 0
        self.num_blocks[index] = len(block_ids)
        params = state.sampling_params
        self.temperature[index] = 0.0 if params.is_greedy else params.temperature
        self.top_p[index] = params.top_p
        self.top_k[index] = params.top_k
        self.min_p[index] = params.min_p
        self.presence_penalty[index] = params.presence_penalty
        self.frequency_penalty[index] = params.frequency_penalty
        self.repetition_penalty[index] = params.repetition_penalty
        self.num_prompt_tokens[index] = prompt_len
        self.num_logprobs[index] = -1 if params.logprobs is None else params.logprobs
        self.num_prompt_logprobs[index] = (
            -1 if params.prompt_logprobs is None else params.prompt_logprobs
        )
        self.has_sparse_params[index] = bool(
            params.logit_bias
            or params.allowed_token_ids
            or params.bad_words_token_ids
            or params.min_tokens
        )
        self.has_penalties[index] = (
            params.presence_penalty != 0
            or params.frequency_penalty != 0
            or params.repetition_penalty != 1
        )
        if state.generator is not None:
            self.generators[index] = state.generator
        return index

    def append_block_ids(self, index: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[index])
        self.block_table[index, start : start + len(block_ids)] = block_ids
        self.num_blocks[index] = start + len(block_ids)

    def remove_request(self, req_id: str) -> None:
        index = self.req_id_to_index.pop(req_id, None)
        if index is None:
            return
        self.version += 1
        self.req_ids[index] = None
        self.generators.pop(index, None)
        self._condense(index)

    def _condense(self, hole: int) -> None:
        last = self.num_reqs  # after the pop, the last used row index
        if hole == last:
            return
        req_id = self.req_ids[last]
        assert req_id is not None
        self.req_ids[hole], self.req_ids[last] = req_id, None
        self.req_id_to_index[req_id] = hole
        n = int(self.num_tokens[last])
        self.token_ids[hole, :n] = self.token_ids[last, :n]
        for array in self._arrays:
            array[hole] = array[last]
        if last in self.generators:
            self.generators[hole] = self.generators.pop(last)
        if self.on_move is not None:
            self.on_move(last, hole)
