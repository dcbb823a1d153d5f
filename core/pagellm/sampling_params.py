"""Sampling parameters of one request, validated when constructed."""

from __future__ import annotations

import math
from enum import IntEnum

import msgspec

_GREEDY_EPS = 1e-5


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to pick the next tokens of one request (the vLLM ``SamplingParams`` subset built so far).

    Invalid values raise ``ValueError`` naming the field as soon as the object is created.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True

    def __post_init__(self) -> None:
        if self.n != 1:
            raise ValueError(f"n must be 1 for now (got {self.n}); n > 1 is not supported yet.")
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disable) or at least 1, got {self.top_k}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}.")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {self.stop_token_ids}.")
        if self.top_k == -1:
            self.top_k = 0
        if self.temperature < _GREEDY_EPS:
            # Greedy: the other knobs do not matter; normalise them so the sampler can skip work.
            self.top_p = 1.0
            self.top_k = 0

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _GREEDY_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    def clone(self) -> SamplingParams:
        return msgspec.structs.replace(self)
