"""Sampling parameters of one request, validated when constructed (vLLM's ``SamplingParams``)."""

from __future__ import annotations

import math
from enum import IntEnum

import msgspec

_GREEDY_EPS = 1e-5
DEFAULT_MAX_LOGPROBS = 20
"""The engine's default ``max_logprobs`` (``--max-logprobs``), as in vLLM."""
# Integers cross the engine's wire as msgpack int64: anything outside is refused when constructed.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; ``param`` names it (the HTTP layer reports it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0
    """Each output carries everything generated so far."""
    DELTA = 1
    """Each output carries only what is new since the previous one (streaming)."""
    FINAL_ONLY = 2
    """Only the finished output is returned."""


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise SamplingParamsError(name, f"{name} must be a number, got {value!r}.")
    return float(value)


def _integer(name: str, value: object, low: int = INT64_MIN, high: int = INT64_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SamplingParamsError(
            name, f"{name} must be an integer in [{low}, {high}], got {value!r}."
        )
    return value


def logprobs_count(name: str, asked: int, max_logprobs: int, vocab_size: int) -> int:
    """How many logprobs a token ``name``'s value ``asked`` means (-1: the whole vocabulary),
    within the engine's ``max_logprobs`` (-1: the vocabulary); ``SamplingParamsError`` naming
    ``name`` beyond it."""
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    count = vocab_size if asked == -1 else asked
    if count > limit:
        raise SamplingParamsError(
            name,
            f"{name}={asked} asks for {count} logprobs a token, more than this server's limit of "
            f"{limit} (--max-logprobs).",
        )
    return count


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to pick the next tokens of one request. Invalid values raise ``ValueError`` naming the
    field as soon as the object is created; checks that need the vocabulary (token ids) happen
    when the request is added."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    bad_words_token_ids: list[list[int]] | None = None
    """Filled by the front end from ``bad_words`` (tokenized with and without a leading space)."""

    def __post_init__(self) -> None:
        _integer("n", self.n, 1)
        self._check("temperature", _number("temperature", self.temperature) >= 0.0, "be >= 0")
        self._check("top_p", 0.0 < _number("top_p", self.top_p) <= 1.0, "be in (0, 1]")
        _integer("top_k", self.top_k, -1)
        self._check("min_p", 0.0 <= _number("min_p", self.min_p) <= 1.0, "be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            self._check(name, -2.0 <= _number(name, getattr(self, name)) <= 2.0, "be in [-2, 2]")
        penalty = _number("repetition_penalty", self.repetition_penalty)
        self._check("repetition_penalty", penalty > 0.0, "be > 0")
        if self.max_tokens is not None:
            _integer("max_tokens", self.max_tokens, 1)
        _integer("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).",
            )
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                # -1: every token of the vocabulary. The engine checks the count against its
                # --max-logprobs when the request is added.
                _integer(name, getattr(self, name), -1)
        if self.seed is not None:
            # Completion i of an n > 1 request samples with seed + i: that must fit too.
            _integer("seed", self.seed, INT64_MIN, INT64_MAX - (self.n - 1))
        if self.logit_bias is not None:
            self.logit_bias = {
                _integer("logit_bias", int(k), 0): max(-100.0, min(100.0, _number("logit_bias", v)))
                for k, v in self.logit_bias.items()
            }
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise SamplingParamsError(
                "allowed_token_ids",
                "allowed_token_ids must not be empty (omit it to allow every token).",
            )
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingParamsError("stop", f"stop must be non-empty strings, got {self.stop!r}.")
        if self.bad_words is not None and any(
            not isinstance(w, str) or not w for w in self.bad_words
        ):
            # An empty word would ban what follows a space: the space token itself.
            raise SamplingParamsError(
                "bad_words", f"bad_words must be non-empty strings, got {self.bad_words!r}."
            )
        for name in ("stop_token_ids", "allowed_token_ids"):
            for token in getattr(self, name) or ():
                _integer(name, token, 0)
        if self.top_k == -1:
            self.top_k = 0
        if self.is_greedy:
            # Greedy: the other knobs do not matter; normalise them so the sampler can skip work.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _check(self, name: str, ok: bool, rule: str) -> None:
        if not ok:
            raise SamplingParamsError(name, f"{name} must {rule}, got {getattr(self, name)}.")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self) -> SamplingParams:
        return msgspec.structs.replace(self)
