"""``POST /v1/completions``: one or several prompts (text or token ids), ``n`` choices each."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagellm.entrypoints.http_errors import bad_request
from pagellm.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagellm_openai.generation import Answer, respond
from pagellm_openai.logprobs import prompt_logprobs_json, token_name, token_text
from pagellm_openai.protocol import CompletionRequest
from pagellm_openai.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    UsageInfo,
)
from pagellm_openai.serving import Prompt, ServingContext
from pagellm_openai.streams import TextChoice

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
        return [ctx.token_prompt(prompt)]
    if isinstance(prompt[0], str):
        return [ctx.text_prompt(p, request.add_special_tokens) for p in prompt]
    return [ctx.token_prompt(p) for p in prompt]


class _Logprobs:
    """Builds the completions API's logprobs object, keeping text offsets across stream chunks.
    A position's ``top_logprobs`` lists its own token first, then the top ones; with
    ``return_tokens_as_token_ids`` tokens are named ``token_id:N`` (offsets stay in the text)."""

    def __init__(self, tokenizer: Any, as_ids: bool) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids
        self.offset = 0

    def _name(self, token_id: int, position: PositionLogprobs | None) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        return token_text(self.tokenizer, token_id, position)

    def build(
        self, token_ids: list[int], positions: list[PositionLogprobs | None]
    ) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for token_id, position in zip(token_ids, positions, strict=False):
            text = token_text(self.tokenizer, token_id, position)
            entry = position.get(token_id) if position else None
            result.tokens.append(token_name(text, token_id, self.as_ids))
            result.token_logprobs.append(entry.logprob if entry is not None else None)
            result.top_logprobs.append(
                None
                if position is None
                else {self._name(t, position): lp.logprob for t, lp in position.items()}
            )
            result.text_offset.append(self.offset)
            self.offset += len(text)
        return result


class _Choice:
    """One choice of a completion, across the chunks of a stream: the echo goes first, the
    logprobs' text offsets continue from chunk to chunk, and the prompt's fields (vLLM's
    ``prompt_logprobs``, ``prompt_token_ids``) come with its first chunk."""

    def __init__(
        self, tokenizer: Any, echo: bool, logprobs: _Logprobs | None, token_ids: bool
    ) -> None:
        self.tokenizer = tokenizer
        self.logprobs = logprobs
        self.echo_pending = echo
        self.token_ids = token_ids
        self.first = True
        self.plain = logprobs is None and not token_ids
        """Unfinished, its chunks after the first carry only their text (`TextChoice`)."""

    def stream_fields(
        self,
        index: int,
        output: RequestOutput,
        completion: CompletionOutput,
        prompt_logprobs: list[PositionLogprobs | None] | None,
    ) -> dict[str, Any] | TextChoice:
        """`fields`, or a `TextChoice` when the chunk carries nothing but the new text."""
        if (
            self.plain
            and not self.echo_pending
            and completion.finish_reason is None
            and completion.stop_reason is None
            and not (self.first and prompt_logprobs is not None)
        ):
            self.first = False
            return TextChoice(index, completion.text)
        return self.fields(index, output, completion, prompt_logprobs)

    def fields(
        self,
        index: int,
        output: RequestOutput,
        completion: CompletionOutput,
        prompt_logprobs: list[PositionLogprobs | None] | None,
    ) -> dict[str, Any]:
        """The choice as a dict in `CompletionChoice`'s field order (a stream chunk's choice);
        the fields of vLLM's only when asked."""
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
        fields: dict[str, Any] = {
            "index": index,
            "text": text,
            "logprobs": self.logprobs.build(ids, positions) if self.logprobs is not None else None,
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }
        first, self.first = self.first, False
        if self.token_ids:
            fields["token_ids"] = completion.token_ids
        if first and prompt_logprobs is not None:
            fields["prompt_logprobs"] = prompt_logprobs_json(prompt_logprobs)
        if first and self.token_ids:
            fields["prompt_token_ids"] = output.prompt_token_ids
        return fields


async def create_completion(
    ctx: ServingContext, request: CompletionRequest, raw: Request
) -> Response:
    model = ctx.model_name(request.model)
    # What truncation leaves room for: the request's max_tokens, else its default (capped by
    # the model's generation config, as output_budget caps it).
    reserved = request.max_tokens or min(
        DEFAULT_MAX_TOKENS, ctx.default_sampling.get("max_tokens", DEFAULT_MAX_TOKENS)
    )
    prompts = [ctx.truncate(p, request, reserved) for p in _prompts(ctx, request)]
    params = [
        ctx.sampling_params(
            request,
            ctx.output_budget(p, request.max_tokens, DEFAULT_MAX_TOKENS, "max_tokens", "prompt"),
            logprobs=request.logprobs,
            echo_logprobs=request.logprobs if request.echo else None,
        )
        for p in prompts
    ]
    if request.echo and ctx.engine.tokenizer is None:
        raise bad_request("echo needs a tokenizer, and this server runs without one.", param="echo")
    request_id = ctx.response_id("cmpl", request, raw)
    generators = [
        ctx.generate(p, sp, request_id if len(prompts) == 1 else f"{request_id}-{i}", request)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    n = request.n
    tokenizer, as_ids = ctx.engine.tokenizer, ctx.tokens_as_ids(request)
    choices = [
        _Choice(
            tokenizer,
            request.echo,
            _Logprobs(tokenizer, as_ids) if request.logprobs is not None else None,
            request.return_token_ids,
        )
        for _ in range(len(prompts) * n)
    ]
    # Streamed, prompt logprobs come with a prompt's first output only; every choice echoes them.
    prompt_logprobs: dict[int, list[PositionLogprobs | None] | None] = {}

    def stream_choice(
        i: int, output: RequestOutput, c: CompletionOutput
    ) -> dict[str, Any] | TextChoice:
        index = i * n + c.index
        choice = choices[index]
        if choice.plain and not choice.first and c.finish_reason is None:
            return TextChoice(index, c.text)  # the token path: only the text is new
        prompt_logprobs.setdefault(i, output.prompt_logprobs)
        return choice.stream_fields(index, output, c, prompt_logprobs[i])

    def final_choice(i: int, output: RequestOutput, c: CompletionOutput) -> CompletionChoice:
        index = i * n + c.index
        return CompletionChoice(**choices[index].fields(index, output, c, output.prompt_logprobs))

    def final_body(
        result: list[CompletionChoice], outputs: list[RequestOutput], usage: UsageInfo
    ) -> CompletionResponse:
        return CompletionResponse(id=request_id, model=model, choices=result, usage=usage)

    answer = Answer(
        request_id=request_id,
        object_name="text_completion",
        model=model,
        prompt_lengths=[len(p.token_ids) for p in prompts],
        stream_choice=stream_choice,
        final_choice=final_choice,
        final_body=final_body,
        prompt_tokens_details=ctx.enable_prompt_tokens_details,
        text_choice=_text_choice,
        text_only=len(choices) == 1 and choices[0].plain,
    )
    return await respond(raw, request, generators, answer)


def _text_choice(index: int, text: str) -> dict[str, Any]:
    """What `_Choice.fields` gives for a chunk of text only (a `TextChoice`)."""
    return {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": None,
        "stop_reason": None,
    }
