"""``POST /v1/completions``: one or several prompts (text or token ids), ``n`` choices each."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagellm.entrypoints.http_errors import bad_request
from pagellm.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagellm_openai.generation import respond
from pagellm_openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from pagellm_openai.serving import Prompt, ServingContext

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions API


def _prompts(ctx: ServingContext, request: CompletionRequest) -> list[Prompt]:
    prompt = request.prompt
    if isinstance(prompt, str):
        ctx.check_num_sequences(1, request.n)
        return [ctx.text_prompt(prompt, request.add_special_tokens)]
    if not prompt:
        raise bad_request("prompt is empty.", param="prompt")
    ctx.check_num_sequences(1 if isinstance(prompt[0], int) else len(prompt), request.n)
    if isinstance(prompt[0], int):
        return [ctx.token_prompt(prompt)]  # type: ignore[arg-type]
    if isinstance(prompt[0], str):
        return [ctx.text_prompt(p, request.add_special_tokens) for p in prompt]  # type: ignore[arg-type]
    return [ctx.token_prompt(p) for p in prompt]  # type: ignore[arg-type]


class _Logprobs:
    """Builds the completions API's logprobs object, keeping text offsets across stream chunks."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.offset = 0

    def token_text(self, token_id: int, position: PositionLogprobs | None) -> str:
        entry = position.get(token_id) if position else None
        if entry is not None and entry.decoded_token is not None:
            return entry.decoded_token
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    def build(
        self, token_ids: list[int], positions: list[PositionLogprobs | None]
    ) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for token_id, position in zip(token_ids, positions, strict=False):
            text = self.token_text(token_id, position)
            entry = position.get(token_id) if position else None
            result.tokens.append(text)
            result.token_logprobs.append(entry.logprob if entry is not None else None)
            result.top_logprobs.append(
                None
                if position is None
                else {
                    self.token_text(t, position): lp.logprob
                    for t, lp in sorted(position.items(), key=lambda kv: kv[1].rank or 0)
                }
            )
            result.text_offset.append(self.offset)
            self.offset += len(text)
        return result


class _Choice:
    """One choice of a completion, across the chunks of a stream: the echo goes first, and the
    logprobs' text offsets continue from chunk to chunk."""

    def __init__(self, tokenizer: Any, echo: bool, logprobs: bool) -> None:
        self.tokenizer = tokenizer
        self.logprobs = _Logprobs(tokenizer) if logprobs else None
        self.echo_pending = echo

    def fields(
        self,
        index: int,
        output: RequestOutput,
        completion: CompletionOutput,
        prompt_logprobs: list[PositionLogprobs | None] | None,
    ) -> dict[str, Any]:
        """The choice as a dict in `CompletionChoice`'s field order (a stream chunk's choice)."""
        text = completion.text
        ids = completion.token_ids
        positions: list[PositionLogprobs | None] = list(completion.logprobs or [])
        if self.echo_pending:
            self.echo_pending = False
            prompt_ids = output.prompt_token_ids
            prompt = output.prompt
            text = (self.tokenizer.decode(prompt_ids) if prompt is None else prompt) + text
            ids = list(prompt_ids) + ids
            positions = list(prompt_logprobs or [None] * len(prompt_ids)) + positions
        return {
            "index": index,
            "text": text,
            "logprobs": self.logprobs.build(ids, positions) if self.logprobs is not None else None,
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }


async def create_completion(
    ctx: ServingContext, request: CompletionRequest, raw: Request
) -> Response:
    model = ctx.model_name(request.model)
    prompts = _prompts(ctx, request)
    echo_logprobs = request.logprobs if request.echo else None
    params = [
        ctx.sampling_params(
            request,
            ctx.output_budget(p, request.max_tokens, DEFAULT_MAX_TOKENS, "max_tokens", "prompt"),
            logprobs=request.logprobs,
            prompt_logprobs=echo_logprobs,
        )
        for p in prompts
    ]
    if request.echo and ctx.engine.tokenizer is None:
        raise bad_request("echo needs a tokenizer, and this server runs without one.", param="echo")
    request_id = f"cmpl-{raw.state.request_id}"
    generators = [
        ctx.generate(p, sp, request_id if len(prompts) == 1 else f"{request_id}-{i}", request)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    n = request.n
    tokenizer, with_logprobs = ctx.engine.tokenizer, request.logprobs is not None
    choices = [_Choice(tokenizer, request.echo, with_logprobs) for _ in range(len(prompts) * n)]
    # Streamed, prompt logprobs come with a prompt's first output only; every choice echoes them.
    prompt_logprobs: dict[int, list[PositionLogprobs | None] | None] = {}

    def stream_choice(i: int, output: RequestOutput, c: CompletionOutput) -> dict[str, Any]:
        prompt_logprobs.setdefault(i, output.prompt_logprobs)
        index = i * n + c.index
        return choices[index].fields(index, output, c, prompt_logprobs[i])

    def final_choice(i: int, output: RequestOutput, c: CompletionOutput) -> CompletionChoice:
        index = i * n + c.index
        return CompletionChoice(**choices[index].fields(index, output, c, output.prompt_logprobs))

    def final_body(result: list[CompletionChoice], usage: UsageInfo) -> CompletionResponse:
        return CompletionResponse(id=request_id, model=model, choices=result, usage=usage)

    return await respond(
        raw,
        request,
        generators,
        request_id=request_id,
        object_name="text_completion",
        model=model,
        num_prompt_tokens=sum(len(p.token_ids) for p in prompts),
        stream_choice=stream_choice,
        final_choice=final_choice,
        final_body=final_body,
    )
