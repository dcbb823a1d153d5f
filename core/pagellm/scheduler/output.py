"""What the scheduler tells the workers each step, and what the engine core returns to the front end."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgspec

from pagellm.multimodal.inputs import MultiModalItem
from pagellm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the workers have not seen: everything needed to build its state."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    """Tokens it generated before the workers dropped it (after a failed step); usually none."""
    mm_items: list[MultiModalItem] = field(default_factory=list)
    """Its prompt's multimodal items: the workers embed them where its steps reach their spans."""


@dataclass
class CachedRequestData:
    """Requests the workers already hold: only what changed since the last step."""

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    """Blocks appended this step; for a resumed request, its whole new block list."""
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: set[str]
    """Requests the workers must take out of the batch (they keep their state to resume)."""
    finished_req_ids: set[str]
    """Requests that ended since the last step: the workers drop their state."""


class SampleLogprobs(msgspec.Struct, array_like=True):
    """Log-probabilities at one sampled position: the sampled token first, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int


class ModelRunnerOutput(msgspec.Struct, array_like=True):
    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    """Per request (in ``req_ids`` order): the tokens sampled this step; empty for a prefill chunk."""
    logprobs: list[SampleLogprobs | None] | None = None
    prompt_logprobs: dict[str, list[SampleLogprobs]] | None = None
    """Per request asking for them: the prompt positions computed this step (next-token logprobs)."""
    pooled: list[bytes] | None = None
    """A pooling model's step: per request (in ``req_ids`` order), its pooled vector as float32
    bytes (native byte order: the engine and its front end share a host); nothing sampled."""


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[SampleLogprobs] | None = None
    finish_reason: int | None = None
    """A `FinishReason` value once the request ended."""
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    new_prompt_logprobs: list[SampleLogprobs] | None = None
    pooled: bytes | None = None
    """A pooling request's result (float32 bytes, `ModelRunnerOutput.pooled`), with its finish."""


class RequestEventType(enum.IntEnum):
    QUEUED = 1
    """The engine core took the request in (it waits to be scheduled)."""
    SCHEDULED = 2
    """It was scheduled for the first time (a resumption after a preemption is not reported)."""


class RequestEvent(msgspec.Struct, array_like=True):
    """A change of a request's state in the engine core, for the front end's timing metrics (queue,
    prefill, inference time). Made only when the state changes, never per step or token."""

    request_id: str
    type: RequestEventType
    timestamp: float
    """The engine core's `time.monotonic()`."""


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    """When the step that made them ended (the engine core's `time.monotonic()`; 0: no step)."""
    events: list[RequestEvent] = []
    """The request events since the previous step's outputs."""
