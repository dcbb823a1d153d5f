"""The front end's state of a request while it runs (`OutputProcessor`'s): per completion its
tokens, text and what of them went out; per user request its completions; and where a stop string
ends a text."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.engine.detokenizer import Detokenizer
from pagellm.outputs import PositionLogprobs
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams
from pagellm.scheduler.output import SampleLogprobs


def find_stop_string(
    text: str, new_chars: int, stops: list[str], include: bool
) -> tuple[str, int] | None:
    """The stop string that ends earliest in ``text`` among those touching its last ``new_chars``
    characters, and where the text is cut (after it if ``include``, else before it)."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if start != -1 and (best is None or start + len(stop) < best[0]):
            best = (start + len(stop), start, stop)
    if best is None:
        return None
    end, start, stop = best
    return stop, end if include else start


@dataclass
class CompletionState:
    """One engine request: one completion of a user request."""

    engine_id: str
    index: int
    params: SamplingParams
    detokenizer: Detokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_chars: int = 0
    sent_logprobs: int = 0
    sent_finish: bool = False
    """Its finish reason went out (in a DELTA output): later outputs of the request omit it."""
    deferred: bool = False
    """Text and logprob entries wait for the end (``FINAL_ONLY`` without stop strings)."""
    samples: list[SampleLogprobs] = field(default_factory=list)
    """A deferred completion's sampled logprobs, not yet made into ``logprobs``."""
    plain_delta: bool = False
    """The only completion of a DELTA request without stop strings, logprobs or prompt
    logprobs: each step's new tokens and text go out as they come (`_plain_delta_output`)."""

    @property
    def holdback(self) -> int:
        """Characters kept back from an unfinished stream: a stop string may still complete there."""
        stops = self.params.stop
        if self.finish_reason is not None or not stops:
            return 0
        return max(len(s) for s in ([stops] if isinstance(stops, str) else stops)) - 1


@dataclass
class RequestState:
    """One user request and its completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[CompletionState]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    output_sent: bool = False
    """An output went out (a DELTA request's prompt logprobs go with its first only)."""
    num_cached_tokens: int = 0
    pooling: PoolingParams | None = None
    """A pooling request: it ends with one pooled vector, ``pooled`` (float32 bytes)."""
    pooled: bytes = b""

    @property
    def finished(self) -> bool:
        completions = self.completions
        if len(completions) == 1:
            return completions[0].finish_reason is not None
        return all(c.finish_reason is not None for c in completions)
