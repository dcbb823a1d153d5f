"""``POST /v1/chat/completions``: the messages rendered by the tokenizer's chat template."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pagellm.entrypoints.http_errors import bad_request
from pagellm.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagellm_openai import streams
from pagellm_openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)
from pagellm_openai.serving import ServingContext


def _token_text(tokenizer: Any, token_id: int, position: PositionLogprobs) -> str:
    entry = position.get(token_id)
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return tokenizer.decode([token_id])


def _logprobs(tokenizer: Any, completion: CompletionOutput, top_n: int) -> ChoiceLogprobs:
    content = []
    for token_id, position in zip(completion.token_ids, completion.logprobs or [], strict=False):
        text = _token_text(tokenizer, token_id, position)
        top = sorted(
            ((t, lp) for t, lp in position.items() if lp.rank is not None and lp.rank <= top_n),
            key=lambda item: item[1].rank or 0,
        )
        tops = [
            TopLogprob(
                token=(tok := _token_text(tokenizer, t, position)),
                logprob=lp.logprob,
                bytes=list(tok.encode()),
            )
            for t, lp in top
        ]
        content.append(
            TokenLogprob(
                token=text,
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
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs=true.", param="top_logprobs")
    ctx.check_num_sequences(1, request.n)
    prompt = ctx.chat_prompt(request.messages, request.add_generation_prompt)
    if request.max_completion_tokens is not None:
        requested, param = request.max_completion_tokens, "max_completion_tokens"
    else:
        requested, param = request.max_tokens, "max_tokens"
    max_tokens = ctx.output_budget(prompt, requested, None, param, "messages")
    top_n = request.top_logprobs or 0
    params = ctx.sampling_params(request, max_tokens, top_n if request.logprobs else None)
    request_id = f"chatcmpl-{raw.state.request_id}"
    generators = [ctx.engine.generate(prompt.engine_input(), params, request_id)]
    tokenizer = ctx.engine.tokenizer
    num_prompt_tokens = len(prompt.token_ids)

    def choice_logprobs(completion: CompletionOutput) -> ChoiceLogprobs | None:
        return _logprobs(tokenizer, completion, top_n) if request.logprobs else None

    if request.stream:
        merged = streams.merge(await streams.start(generators))
        include_usage = request.stream_options is not None and request.stream_options.include_usage

        chunk = streams.chunk_writer(request_id, "chat.completion.chunk", model)

        def stream_choice(
            index: int,
            delta: dict[str, str | None],
            logprobs: ChoiceLogprobs | None = None,
            finish_reason: str | None = None,
            stop_reason: int | str | None = None,
        ) -> dict[str, Any]:
            # `ChatStreamChoice`'s fields, as a dict.
            return {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }

        async def events() -> AsyncGenerator[bytes, None]:
            generated = 0
            try:
                for index in range(request.n):
                    role = {"role": "assistant", "content": ""}
                    yield chunk([stream_choice(index, role)])
                async for _, output in merged:
                    for c in output.outputs:
                        generated += len(c.token_ids)
                        delta = {"role": None, "content": c.text}
                        yield chunk(
                            [
                                stream_choice(
                                    c.index,
                                    delta,
                                    choice_logprobs(c),
                                    c.finish_reason,
                                    c.stop_reason,
                                )
                            ]
                        )
                if include_usage:
                    yield chunk([], streams.usage(num_prompt_tokens, generated))
            except Exception as exc:
                yield streams.error_event(exc, raw.state.request_id)
            finally:
                await merged.aclose()
            yield streams.DONE

        return StreamingResponse(events(), media_type="text/event-stream")

    async def final_output() -> list[RequestOutput]:
        return await streams.collect_last(streams.merge(await streams.start(generators)), 1)

    completed, outputs = await streams.unless_disconnected(raw, final_output())
    if not completed or outputs is None:
        return Response(status_code=499)  # the client left; nobody reads this
    output = outputs[0]
    choices = [
        ChatChoice(
            index=c.index,
            message=AssistantMessage(content=c.text),
            logprobs=choice_logprobs(c),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in sorted(output.outputs, key=lambda c: c.index)
    ]
    generated = sum(len(c.token_ids) for c in output.outputs)
    usage = UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=generated,
        total_tokens=num_prompt_tokens + generated,
    )
    body = ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
    return Response(body.model_dump_json(), media_type="application/json")
