"""How responses name tokens in logprobs, and vLLM's ``prompt_logprobs`` in JSON shape."""

from __future__ import annotations

from typing import Any

from pagellm.outputs import PositionLogprobs

# JSON has no infinities: a token the model gives no chance gets OpenAI's and vLLM's floor.
LOGPROB_FLOOR = -9999.0


def token_text(tokenizer: Any, token_id: int, position: PositionLogprobs | None) -> str:
    """The token's text: as the engine decoded it, else decoded here."""
    entry = position.get(token_id) if position else None
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return str(tokenizer.decode([token_id])) if tokenizer is not None else ""


def token_name(text: str, token_id: int, as_ids: bool) -> str:
    """How logprobs name a token: its text, or ``token_id:N`` (``return_tokens_as_token_ids``,
    for tokens whose text is not valid on its own, such as part of a UTF-8 character)."""
    return f"token_id:{token_id}" if as_ids else text


def prompt_logprobs_json(
    positions: list[PositionLogprobs | None] | None,
) -> list[dict[int, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, then token id ->
    ``{logprob, rank, decoded_token}``, the prompt's own token first, then the top ones."""
    if positions is None:
        return None
    return [
        None
        if position is None
        else {
            token: {
                "logprob": max(lp.logprob, LOGPROB_FLOOR),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for token, lp in position.items()
        }
        for position in positions
    ]
