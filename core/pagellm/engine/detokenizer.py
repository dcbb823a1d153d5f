"""Incremental detokenization: each new token's text from a short window of recent tokens.

Decoding the whole output every step costs O(n) per token; here only the tokens since the last
emitted boundary are decoded. Text is held back while the window ends in an incomplete UTF-8
sequence (the tokenizer renders it as U+FFFD).
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.output_text = ""

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens))

    def update(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the text they completed (possibly empty)."""
        delta = []
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            new_text = self._decode(self.token_ids[self.prefix_offset :])
            if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
                delta.append(new_text[len(prefix_text) :])
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.token_ids)
        text = "".join(delta)
        self.output_text += text
        return text
