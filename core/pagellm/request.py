"""The engine core's view of one request: its tokens, progress, status and prefix-cache hashes."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence

import msgspec

from pagellm.multimodal.inputs import MultiModalItem
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    """The request made an engine step fail; the others went on."""

    def __str__(self) -> str:
        return self.name.lower()


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is a finished state.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request as the front end hands it to the engine core (a wire struct); the engine core
    builds its `Request` from these fields, which are the first arguments of `Request`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    mm_items: list[MultiModalItem] = []
    """The prompt's multimodal items (images), in prompt order, their placeholders expanded."""
    pooling_params: PoolingParams | None = None
    """Set for a pooling model's request: it runs once over its prompt and returns the pooled
    vector; its ``sampling_params`` (`POOLING_SAMPLING_PARAMS`) only bound it to that step."""


POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
"""What a pooling request carries as sampling parameters: one step (``max_tokens`` 1, which
asynchronous scheduling reads to schedule it no further), nothing sampled."""


class Request:
    """Mutable per-request state owned by the scheduler.

    ``num_computed_tokens`` catches up with ``num_tokens``; there is no prefill or decode phase.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        mm_items: list[MultiModalItem] | None = None,
        pooling_params: PoolingParams | None = None,
        block_hasher: Callable[[Request], list[bytes]] | None = None,
    ) -> None:
        self.request_id = request_id
        # A tuple of ints: the garbage collector stops tracking it after the first collection it
        # survives, so full collections do not walk every running request's prompt again.
        self.prompt_token_ids: tuple[int, ...] = tuple(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.mm_items = list(mm_items or ())
        self.pooling_params = pooling_params
        self.max_tokens = sampling_params.max_tokens

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        """Tokens scheduled to be sampled whose values have not come back yet (asynchronous
        scheduling keeps one step in flight: up to 2 just after `schedule`, else 0 or 1).
        ``num_computed_tokens`` counts the positions they will fill."""
        self.num_cached_tokens = -1  # prefix-cache hit length at first scheduling
        self.num_preemptions = 0

        self._block_hasher = block_hasher
        # Hash again only once another block is full (the hasher says its block size).
        self._hash_block_size: int = getattr(block_hasher, "block_size", 1)
        self.block_hashes: list[bytes] = []
        self.update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """The prompt then the output, as a new list (no list of them is kept: it would be one
        more list per request for every full garbage collection to walk)."""
        return [*self.prompt_token_ids, *self.output_token_ids]

    def token_slice(self, start: int, end: int) -> Sequence[int]:
        """``all_token_ids[start:end]`` without building the whole list."""
        prompt_len = self.num_prompt_tokens
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return [*self.prompt_token_ids[start:], *self.output_token_ids[: end - prompt_len]]

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        """Hash the blocks that became full since the last call."""
        if self._block_hasher is not None and self.num_tokens >= self._hash_block_size * (
            len(self.block_hashes) + 1
        ):
            self.block_hashes.extend(self._block_hasher(self))

    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def get_finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
