"""Incremental detokenization: each new token's text without re-decoding the whole output.

Fast path: the tokenizers library's streaming decoder (``DecodeStream``), primed with the end of
the prompt so the first output token gets its leading space right. Fallback (slow tokenizers, or
``spaces_between_special_tokens=False``): decode a short window of recent tokens and emit the part
that grew, holding back while the window ends in an incomplete UTF-8 sequence (U+FFFD).
"""

from __future__ import annotations

from typing import Any

from pagellm.sampling_params import SamplingParams

_PROMPT_CONTEXT = 6  # prompt tokens fed to the decoder first, for correct spacing


class IncrementalDetokenizer:
    """The fallback: works with any tokenizer that has ``decode``."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.spaces_between_special_tokens = params.spaces_between_special_tokens
        context = prompt_token_ids[-_PROMPT_CONTEXT:]
        self.token_ids: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)

    def _decode(self, ids: list[int]) -> str:
        kwargs = {"skip_special_tokens": self.skip_special_tokens}
        if not self.spaces_between_special_tokens:
            kwargs["spaces_between_special_tokens"] = False
        return str(self.tokenizer.decode(ids, **kwargs))

    def _step(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return new_text[len(prefix_text) :]
        return ""

    def update(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the text they completed (possibly empty)."""
        if len(new_token_ids) == 1:
            return self._step(new_token_ids[0])
        return "".join(self._step(t) for t in new_token_ids)


class FastIncrementalDetokenizer(IncrementalDetokenizer):
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        from tokenizers.decoders import DecodeStream

        super().__init__(tokenizer, prompt_token_ids, params)
        self._backend = tokenizer.backend_tokenizer
        context = prompt_token_ids[-_PROMPT_CONTEXT:]
        self._stream = DecodeStream(ids=context, skip_special_tokens=params.skip_special_tokens)

    def _step(self, token_id: int) -> str:
        return self._stream.step(self._backend, token_id) or ""

    def update(self, new_token_ids: list[int]) -> str:
        if len(new_token_ids) == 1:  # one call less on the per-token path
            return self._stream.step(self._backend, new_token_ids[0]) or ""
        return "".join(self._step(t) for t in new_token_ids)


def make_detokenizer(
    tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams
) -> IncrementalDetokenizer:
    fast = getattr(tokenizer, "is_fast", False) and params.spaces_between_special_tokens
    if fast:
        try:
            return FastIncrementalDetokenizer(tokenizer, prompt_token_ids, params)
        except (ImportError, TypeError, AttributeError):
            pass  # an older tokenizers without DecodeStream(ids=...): the fallback works everywhere
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, params)
