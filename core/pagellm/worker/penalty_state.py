"""Per-row token statistics for the repetition, frequency and presence penalties, kept on the
device and updated incrementally: a request's prompt and past output are counted once, when its
row is filled, and each step adds only the tokens just sampled. So no step does work that grows
with the context. The tensors are allocated when the first request with a penalty arrives.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagellm.worker.step_buffers import small_to_device


class PenaltyState:
    def __init__(
        self, max_num_reqs: int, vocab_size: int, device: torch.device, pin_memory: bool = False
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device
        self.pin_memory = pin_memory
        """Copy token ids through pinned memory, non-blocking (see `StepBuffers.to_device`)."""
        self.output_counts: torch.Tensor | None = None
        """[max_num_reqs, V] float32: how often each token occurs in the row's output."""
        self.prompt_mask: torch.Tensor | None = None
        """[max_num_reqs, V] bool: the tokens of the row's prompt."""

    def _allocate(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.output_counts is None or self.prompt_mask is None:
            shape = (self.max_num_reqs, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.float32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        return self.output_counts, self.prompt_mask

    def fill_row(
        self, row: int, prompt_token_ids: Sequence[int], output_token_ids: list[int]
    ) -> None:
        """A request (new, or resumed after preemption) takes ``row``."""
        counts, mask = self._allocate()
        counts[row].zero_()
        mask[row].zero_()
        mask[row, self._to_device(prompt_token_ids)] = True
        if output_token_ids:
            tokens = self._to_device(output_token_ids)
            counts[row].index_add_(0, tokens, torch.ones_like(tokens, dtype=torch.float32))

    def _to_device(self, token_ids: Sequence[int]) -> torch.Tensor:
        return small_to_device(np.asarray(token_ids, dtype=np.int64), self.device, self.pin_memory)

    def move_row(self, src: int, dst: int) -> None:
        """The batch moved a request from row ``src`` to ``dst`` (condensing)."""
        if self.output_counts is not None and self.prompt_mask is not None:
            self.output_counts[dst] = self.output_counts[src]
            self.prompt_mask[dst] = self.prompt_mask[src]

    def add_sampled(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count this step's sampled tokens (device tensors, no host round trip)."""
        if self.output_counts is not None:
            ones = torch.ones(rows.shape[0], dtype=torch.float32, device=self.device)
            self.output_counts.index_put_((rows, token_ids), ones, accumulate=True)

    def gather(
        self, rows: torch.Tensor, with_prompt_mask: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        counts, mask = self._allocate()
        prompt_mask = mask.index_select(0, rows) if with_prompt_mask else None
        return counts.index_select(0, rows), prompt_mask
