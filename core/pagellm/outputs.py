"""What `LLM.generate` returns. msgspec structs: built for every request at every streaming step,
they must be cheap to make."""

from __future__ import annotations

import msgspec


class Logprob(msgspec.Struct):
    """Log-probability of one token, its rank in the distribution and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's log-probabilities: token id -> Logprob (the sampled token plus the top-k).
PositionLogprobs = dict[int, Logprob]


class CompletionOutput(msgspec.Struct):
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput(msgspec.Struct):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = []
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    """Per prompt token: None for the first, then its logprob given the tokens before it (and the top-k)."""
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache."""


class EmbeddingOutput(msgspec.Struct):
    embedding: list[float]
    """The pooled vector (L2-normalized when the request's ``normalize`` resolved so); empty for
    a request that was aborted or failed."""

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


class EmbeddingRequestOutput(msgspec.Struct):
    """What `LLM.embed` returns per prompt (vLLM's ``EmbeddingRequestOutput``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    prompt: str | None = None
    finish_reason: str | None = None
    """"stop" once pooled; "abort" or "error" when it ended without a vector."""


AnyRequestOutput = RequestOutput | EmbeddingRequestOutput
"""What the front end hands out: a generation's output, or a pooling request's."""
