"""Each step's `SamplingMetadata`, gathered from the persistent batch's per-row parameters.

The dense parameters (temperature, top-p, top-k, min-p, logprobs) only change when the batch
does, so they and their device copies are reused until a request joins or leaves or other rows
sample. Penalties are gathered from `PenaltyState` every step; logit bias, allowed tokens, bad
words and min_tokens are per-row lists, rare enough to gather in Python for the rows using them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import torch

from pagellm.layers.sampler import Penalties, SamplingMetadata
from pagellm.worker.input_batch import CachedRequestState, InputBatch
from pagellm.worker.penalty_state import PenaltyState
from pagellm.worker.step_buffers import small_to_device


class SamplingMetadataBuilder:
    def __init__(
        self,
        batch: InputBatch,
        requests: Mapping[str, CachedRequestState],
        penalty_state: PenaltyState,
        vocab_size: int,
        device: torch.device,
        seed: int,
        pin_memory: bool = False,
    ) -> None:
        self.batch = batch
        self.pin_memory = pin_memory
        """Copy parameters through pinned memory, non-blocking (see `StepBuffers.to_device`)."""
        self.requests = requests
        self.penalty_state = penalty_state
        self.vocab_size = vocab_size
        self.device = device
        self.default_generator = torch.Generator(device=device).manual_seed(seed)
        """Draws for the rows of requests without a seed of their own."""
        self._cache: tuple[tuple[int, bytes], SamplingMetadata] | None = None

    def build(self, rows: np.ndarray) -> SamplingMetadata:
        """The metadata of the batch rows ``rows``, which sample this step (in this order)."""
        batch = self.batch
        key = (batch.version, rows.tobytes())
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self._dense(rows))
        metadata = self._cache[1]
        penalties = self._penalties(rows)
        sparse = np.flatnonzero(batch.has_sparse_params[rows])
        if penalties is None and not len(sparse):
            return metadata
        metadata = dataclasses.replace(metadata, penalties=penalties)
        if len(sparse):
            self._add_sparse(metadata, sparse, rows[sparse])
        return metadata

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return small_to_device(array, self.device, self.pin_memory)

    def _dense(self, rows: np.ndarray) -> SamplingMetadata:
        batch, vocab = self.batch, self.vocab_size
        temperature = batch.temperature[rows]
        top_p = batch.top_p[rows]
        top_k = batch.top_k[rows]
        min_p = batch.min_p[rows]
        num_logprobs = batch.num_logprobs[rows]
        generators = {
            j: batch.generators[int(r)] for j, r in enumerate(rows) if int(r) in batch.generators
        }
        return SamplingMetadata(
            temperature=self._to_device(temperature),
            all_greedy=bool((temperature == 0).all()),
            all_random=bool((temperature > 0).all()),
            top_p=self._to_device(top_p) if (top_p < 1).any() else None,
            top_k=self._to_device(np.where(top_k > 0, np.minimum(top_k, vocab), vocab))
            if (top_k > 0).any()
            else None,
            min_p=self._to_device(min_p) if (min_p > 0).any() else None,
            generators=generators,
            default_generator=self.default_generator,
            max_num_logprobs=int(num_logprobs.max()) if (num_logprobs >= 0).any() else None,
        )

    def _penalties(self, rows: np.ndarray) -> Penalties | None:
        batch = self.batch
        if not batch.has_penalties[rows].any():
            return None
        repetition = batch.repetition_penalty[rows]
        counts, prompt_mask = self.penalty_state.gather(
            self._to_device(rows), with_prompt_mask=bool((repetition != 1).any())
        )
        return Penalties(
            presence=self._to_device(batch.presence_penalty[rows]),
            frequency=self._to_device(batch.frequency_penalty[rows]),
            repetition=self._to_device(repetition),
            output_counts=counts,
            prompt_mask=prompt_mask,
        )

    def _add_sparse(
        self, metadata: SamplingMetadata, positions: np.ndarray, rows: np.ndarray
    ) -> None:
        """Logit bias, allowed tokens, bad words and min_tokens of the rows ``rows``, which sit at
        ``positions`` in the metadata."""
        batch, vocab = self.batch, self.vocab_size
        bias_rows: list[int] = []
        bias_tokens: list[int] = []
        bias_values: list[float] = []
        ban_rows: list[int] = []
        ban_tokens: list[int] = []
        allowed: torch.Tensor | None = None
        for j, row in zip(positions.tolist(), rows.tolist(), strict=True):
            state = self.requests[batch.req_ids[row]]
            params = state.sampling_params
            # Only the output's length and its last few tokens matter: nothing here grows with it.
            n = int(batch.num_tokens[row])
            output_len = n - int(batch.num_prompt_tokens[row])
            if params.logit_bias:
                bias_rows += [j] * len(params.logit_bias)
                bias_tokens += list(params.logit_bias)
                bias_values += list(params.logit_bias.values())
            if params.allowed_token_ids:
                if allowed is None:
                    allowed = torch.ones(metadata.temperature.shape[0], vocab, dtype=torch.bool)
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
        to_device = self._to_device
        if bias_rows:
            metadata.logit_bias = (
                to_device(np.asarray(bias_rows, dtype=np.int64)),
                to_device(np.asarray(bias_tokens, dtype=np.int64)),
                to_device(np.asarray(bias_values, dtype=np.float32)),
            )
        if ban_rows:
            keep = [i for i, t in enumerate(ban_tokens) if t < vocab]
            metadata.banned = (
                to_device(np.asarray([ban_rows[i] for i in keep], dtype=np.int64)),
                to_device(np.asarray([ban_tokens[i] for i in keep], dtype=np.int64)),
            )
        if allowed is not None:
            metadata.allowed_mask = to_device(allowed.numpy())
