"""The answer of a generation route, streamed or not: what completions and chat completions share.

A route submits its engine requests, then says only how one completion becomes a choice: a stream
chunk's (a dict in the response model's field order) or the final body's (a model).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm_openai import streams
from pagellm_openai.protocol import SamplingRequest, UsageInfo

# (index of the prompt, its output, one completion of it) -> a choice
ChoiceMaker = Callable[[int, RequestOutput, CompletionOutput], Any]


async def respond(
    raw: Request,
    request: SamplingRequest,
    generators: list[AsyncGenerator[RequestOutput, None]],
    *,
    request_id: str,
    object_name: str,
    model: str,
    num_prompt_tokens: int,
    stream_choice: ChoiceMaker,
    final_choice: ChoiceMaker,
    final_body: Callable[[list[Any], UsageInfo], BaseModel],
    opening: list[dict[str, Any]] | None = None,
) -> Response:
    """Server-Sent Events (``opening`` choices first, one chunk per completion of each output,
    usage when asked, ``[DONE]``; an error event if the request fails midway), or one body of
    the final choices sorted by index. Bad input is refused (400) before a response begins."""
    if request.stream:
        merged = streams.merge(await streams.start(generators))
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        chunk = streams.chunk_writer(request_id, object_name, model)

        async def events() -> AsyncGenerator[bytes, None]:
            generated = 0
            try:
                for choice in opening or ():
                    yield chunk([choice])
                async for i, output in merged:
                    for c in output.outputs:
                        generated += len(c.token_ids)
                        yield chunk([stream_choice(i, output, c)])
                if include_usage:
                    yield chunk([], streams.usage(num_prompt_tokens, generated))
            except Exception as exc:
                yield streams.error_event(exc, raw.state.request_id)
            finally:
                await merged.aclose()
            yield streams.DONE

        return StreamingResponse(events(), media_type="text/event-stream")

    async def final_outputs() -> list[RequestOutput]:
        merged = streams.merge(await streams.start(generators))
        return await streams.collect_last(merged, len(generators))

    completed, outputs = await streams.unless_disconnected(raw, final_outputs())
    if not completed or outputs is None:
        return Response(status_code=499)  # the client left; nobody reads this
    choices = [final_choice(i, o, c) for i, o in enumerate(outputs) for c in o.outputs]
    choices.sort(key=lambda choice: choice.index)
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    body = final_body(choices, UsageInfo(**streams.usage(num_prompt_tokens, generated)))
    return Response(body.model_dump_json(), media_type="application/json")
