"""``POST /v1/chat/completions``: the messages rendered by a chat template (`chat_template`); with
``echo``, each answer starts with the last message's content when it has the answer's role."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagellm.entrypoints.http_errors import bad_request
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm_openai.chat_template import echoed_text
from pagellm_openai.generation import Answer, respond
from pagellm_openai.logprobs import prompt_logprobs_json, token_name, token_text
from pagellm_openai.protocol import ChatCompletionRequest
from pagellm_openai.responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChoiceLogprobs,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)
from pagellm_openai.serving import ServingContext
from pagellm_openai.streams import TextChoice


def _logprobs(
    tokenizer: Any, completion: CompletionOutput, top_n: int, as_ids: bool
) -> ChoiceLogprobs:
    """Each token and the top ``top_n``; ``bytes`` are always those of the token's text, also
    when ``return_tokens_as_token_ids`` names it ``token_id:N``."""
    content = []
    for token_id, position in zip(completion.token_ids, completion.logprobs or [], strict=False):
        text = token_text(tokenizer, token_id, position)
        top = sorted(
            ((t, lp) for t, lp in position.items() if lp.rank is not None and lp.rank <= top_n),
            key=lambda item: item[1].rank or 0,
        )
        tops = [
            TopLogprob(
                token=token_name(top_text := token_text(tokenizer, t, position), t, as_ids),
                logprob=lp.logprob,
                bytes=list(top_text.encode()),
            )
            for t, lp in top
        ]
        content.append(
            TokenLogprob(
                token=token_name(text, token_id, as_ids),
                logprob=position[token_id].logprob,
                bytes=list(text.encode()),
                top_logprobs=tops,
            )
        )
    return ChoiceLogprobs(content=content)


async def create_chat_completion(
    ctx: ServingContext, request: ChatCompletionRequest, raw: Request
) -> Response:
    model = ctx.model_name(request.model)
    if request.top_logprobs and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs=true.", param="top_logprobs")
    ctx.check_num_sequences(1, request.n)
    prompt, role = await ctx.chat_prompt_with_media(request)
    echo = echoed_text(request, role) if request.echo else ""
    requested: int | None
    if request.max_completion_tokens is not None:
        requested, param = request.max_completion_tokens, "max_completion_tokens"
    else:
        requested, param = request.max_tokens, "max_tokens"
    prompt = ctx.truncate(prompt, request, requested or 1)
    max_tokens = ctx.output_budget(prompt, requested, None, param, "messages")
    top_n = request.top_logprobs or 0
    params = ctx.sampling_params(
        request, max_tokens, top_n if request.logprobs else None, logprobs_param="top_logprobs"
    )
    request_id = ctx.response_id("chatcmpl", request, raw)
    tokenizer, as_ids = ctx.engine.tokenizer, ctx.tokens_as_ids(request)
    token_ids = request.return_token_ids

    def choice_logprobs(completion: CompletionOutput) -> ChoiceLogprobs | None:
        shown = ctx.vocab_size if top_n == -1 else top_n  # -1: the whole vocabulary
        return _logprobs(tokenizer, completion, shown, as_ids) if request.logprobs else None

    def stream_choice(
        index: int, delta: dict[str, str | None], c: CompletionOutput | None = None
    ) -> dict[str, Any]:
        """`ChatStreamChoice`'s fields, as a dict: a role, or completion ``c``'s new text."""
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": None if c is None else choice_logprobs(c),
            "finish_reason": None if c is None else c.finish_reason,
            "stop_reason": None if c is None else c.stop_reason,
        }
        if token_ids and c is not None:
            choice["token_ids"] = c.token_ids
        return choice

    plain = not request.logprobs and not token_ids

    def delta_choice(
        _: int, output: RequestOutput, c: CompletionOutput
    ) -> dict[str, Any] | TextChoice:
        if plain and c.finish_reason is None and c.stop_reason is None:
            return TextChoice(c.index, c.text)  # the chunk `text_choice` makes, from a template
        return stream_choice(c.index, {"role": None, "content": c.text}, c)

    def text_choice(index: int, text: str) -> dict[str, Any]:
        return stream_choice(index, {"role": None, "content": text})

    def output_fields(_: int, output: RequestOutput) -> dict[str, Any]:
        """The prompt's logprobs, with the first output (a stream's first chunk after its roles)."""
        if output.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": prompt_logprobs_json(output.prompt_logprobs)}

    def final_choice(_: int, output: RequestOutput, c: CompletionOutput) -> ChatChoice:
        return ChatChoice(
            index=c.index,
            message=AssistantMessage(role=role, content=echo + c.text),
            logprobs=choice_logprobs(c),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            token_ids=c.token_ids if token_ids else None,
        )

    def final_body(
        choices: list[ChatChoice], outputs: list[RequestOutput], usage: UsageInfo
    ) -> ChatCompletionResponse:
        [output] = outputs
        return ChatCompletionResponse(
            id=request_id,
            model=model,
            choices=choices,
            usage=usage,
            prompt_logprobs=prompt_logprobs_json(output.prompt_logprobs),  # type: ignore[arg-type]
            prompt_token_ids=output.prompt_token_ids if token_ids else None,
        )

    answer = Answer(
        request_id=request_id,
        object_name="chat.completion.chunk",
        model=model,
        prompt_lengths=[len(prompt.token_ids)],
        stream_choice=delta_choice,
        final_choice=final_choice,
        final_body=final_body,
        prompt_tokens_details=ctx.enable_prompt_tokens_details,
        opening=[
            *(stream_choice(i, {"role": role, "content": ""}) for i in range(request.n)),
            *(stream_choice(i, {"role": None, "content": echo}) for i in range(request.n) if echo),
        ],
        opening_fields={"prompt_token_ids": prompt.token_ids} if token_ids else {},
        output_fields=output_fields,
        text_choice=text_choice,
        text_only=request.n == 1 and plain and request.prompt_logprobs is None,
    )
    return await respond(raw, request, [ctx.generate(prompt, params, request_id, request)], answer)
