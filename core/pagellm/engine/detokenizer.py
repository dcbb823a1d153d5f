"""Incremental detokenization: each new token's text without re-decoding the whole output.

Fast path: the tokenizers library's streaming decoder (``DecodeStream``), primed with the end of
the prompt so the first output token gets its leading space right. Fallback (slow tokenizers, or
``spaces_between_special_tokens=False``): decode a short window of recent tokens and emit the part
that grew, holding back while the window ends in an incomplete UTF-8 sequence (U+FFFD).

A request whose text is only wanted whole (``FINAL_ONLY`` without stop strings) takes it in one
call at its end, `decode_all`: with a byte-level decoder (SmolLM2, Llama 3, Qwen) a single decode
of the output gives what the token-by-token stream would have: such a decoder maps each token to
bytes on its own, so the stream's windows join up to the whole decode, except at an end inside an
unfinished character, which the stream holds back (there, and for other decoders, the output goes
through the stream after all).

``spaces_between_special_tokens=False`` (with special tokens kept) is vLLM's: a special token right
after another comes as its bare text, without the space a decoder may put between them (WordPiece
decoders do; byte-level BPE ones put none, so it changes nothing there).
"""

from __future__ import annotations

from typing import Any

from pagellm.sampling_params import SamplingParams

_PROMPT_CONTEXT = 6  # prompt tokens fed to the decoder first, for correct spacing
_MAX_UTF8_TAIL = 3  # tokens at most that a prompt can end with inside one UTF-8 character


def prompt_context(
    tokenizer: Any, prompt_token_ids: list[int]
) -> tuple[list[int], list[int], bool]:
    """The prompt's last tokens, split where its text last ends on a whole character: (the whole
    part, the tokens after it, whether such a split was found). A prompt of token ids may stop
    inside a UTF-8 character, which the first output tokens complete; that character then belongs
    to the output. Without a split (more broken bytes than a character has) it is all context."""
    context = prompt_token_ids[-_PROMPT_CONTEXT:]
    for cut in range(len(context), max(0, len(context) - _MAX_UTF8_TAIL) - 1, -1):
        if not str(tokenizer.decode(context[:cut])).endswith("\ufffd"):
            return context[:cut], context[cut:], True
    return context, [], False


class IncrementalDetokenizer:
    """The fallback: works with any tokenizer that has ``decode``."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.spaces_between_special_tokens = params.spaces_between_special_tokens
        whole, tail, _ = prompt_context(tokenizer, prompt_token_ids)
        self.token_ids: list[int] = whole + tail
        self.prefix_offset = 0
        self.read_offset = len(whole)
        joins_specials = not params.spaces_between_special_tokens and not params.skip_special_tokens
        self.special_texts: dict[int, str] = (
            {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
            if joins_specials and hasattr(tokenizer, "added_tokens_decoder")
            else {}
        )
        self.after_special = False

    def _decode(self, ids: list[int]) -> str:
        kwargs = {"skip_special_tokens": self.skip_special_tokens}
        if not self.spaces_between_special_tokens:
            kwargs["spaces_between_special_tokens"] = False
        return str(self.tokenizer.decode(ids, **kwargs))

    def _step(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        special = self.special_texts.get(token_id)
        after_special, self.after_special = self.after_special, special is not None
        if special is not None and after_special:
            # Its bare text; the window restarts at it, so what follows is decoded after it.
            self.prefix_offset, self.read_offset = len(self.token_ids) - 1, len(self.token_ids)
            return special
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return new_text[len(prefix_text) :]
        return ""

    def update(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the text they completed (possibly empty)."""
        return "".join(self._step(t) for t in new_token_ids)

    def decode_all(self, token_ids: list[int]) -> str:
        """The text of a whole output, on a detokenizer not updated yet: here, token by token."""
        return self.update(token_ids)


class FastIncrementalDetokenizer:
    """The tokenizers library's ``DecodeStream`` (fast tokenizers)."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = tokenizer.backend_tokenizer
        whole, tail, split = prompt_context(tokenizer, prompt_token_ids)
        self._skip_special_tokens = params.skip_special_tokens
        self._stream = DecodeStream(ids=whole, skip_special_tokens=params.skip_special_tokens)
        for token_id in tail:  # an unfinished character: no text until the output completes it
            self._stream.step(self._backend, token_id)
        self._tail = tail
        # The whole decode needs bytes decoded token by token, after a prompt ending on a whole
        # character (or not at all).
        self._decodes_whole = split and _is_byte_level(self._backend)

    def update(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the text they completed (possibly empty)."""
        step, backend = self._stream.step, self._backend
        if len(new_token_ids) == 1:  # one call less on the per-token path
            return step(backend, new_token_ids[0]) or ""
        return "".join(step(backend, t) or "" for t in new_token_ids)

    def decode_all(self, token_ids: list[int]) -> str:
        """The text of a whole output, on a detokenizer not updated yet: what ``update`` would
        return, in one decode where the decoder is byte-level (see the module docstring)."""
        if self._decodes_whole:
            text = str(
                self._backend.decode(
                    self._tail + token_ids, skip_special_tokens=self._skip_special_tokens
                )
            )
            if not text.endswith("\ufffd"):
                return text
        return self.update(token_ids)


def _is_byte_level(backend: Any) -> bool:
    from tokenizers.decoders import ByteLevel

    return isinstance(backend.decoder, ByteLevel)


Detokenizer = IncrementalDetokenizer | FastIncrementalDetokenizer


def make_detokenizer(
    tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams
) -> Detokenizer:
    spaces = params.spaces_between_special_tokens or params.skip_special_tokens
    fast = getattr(tokenizer, "is_fast", False) and spaces
    if fast:
        try:
            return FastIncrementalDetokenizer(tokenizer, prompt_token_ids, params)
        except (ImportError, TypeError, AttributeError):
            pass  # an older tokenizers without DecodeStream(ids=...): the fallback works everywhere
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, params)
