"""The answer of a generation route, streamed or not: what completions and chat completions share.

A route submits its engine requests, then says only how one completion becomes a choice: a stream
chunk's (a dict in the response model's field order) or the final body's (a model), and which
fields beside the choices a chunk carries (vLLM's ``prompt_token_ids``, ``prompt_logprobs``).
Usage is counted here: in the last chunk or the body, and, with ``continuous_usage_stats``, in
every chunk (its prompt's tokens and its choice's tokens so far).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm_openai import streams
from pagellm_openai.protocol import SamplingRequest, UsageInfo

# (index of the prompt, its output, one completion of it) -> a choice
ChoiceMaker = Callable[[int, RequestOutput, CompletionOutput], Any]


@dataclass
class Answer:
    """What a route says about its response; `respond` does the rest."""

    request_id: str
    object_name: str
    """The ``object`` of a stream chunk."""
    model: str
    prompt_lengths: list[int]
    """Tokens of each prompt, in the order of the engine requests."""
    stream_choice: ChoiceMaker
    final_choice: ChoiceMaker
    final_body: Callable[[list[Any], list[RequestOutput], UsageInfo], BaseModel]
    """The body, from the sorted final choices, each prompt's final output and the usage."""
    prompt_tokens_details: bool = False
    """``usage.prompt_tokens_details`` with the prompt tokens found in the prefix cache."""
    opening: list[dict[str, Any]] = field(default_factory=list)
    """Choices of the chunks a stream opens with, before any output (chat's roles)."""
    opening_fields: dict[str, Any] = field(default_factory=dict)
    """Fields beside the choices of the first opening chunk."""
    output_fields: Callable[[int, RequestOutput], dict[str, Any]] | None = None
    """Fields beside the choices of the first chunk made from an output."""

    def usage(self, outputs: dict[int, RequestOutput], generated: int) -> dict[str, Any]:
        cached = sum(o.num_cached_tokens for o in outputs.values())
        return streams.usage(
            sum(self.prompt_lengths), generated, cached if self.prompt_tokens_details else None
        )


async def respond(
    raw: Request,
    request: SamplingRequest,
    generators: list[AsyncGenerator[RequestOutput, None]],
    answer: Answer,
) -> Response:
    """Server-Sent Events (``opening`` choices first, one chunk per completion of each output,
    usage when asked, ``[DONE]``; an error event if the request fails midway), or one body of
    the final choices sorted by index. Bad input is refused (400) before a response begins."""
    if request.stream:
        return await _stream(raw, request, generators, answer)

    async def final_outputs() -> list[RequestOutput]:
        merged = streams.merge(await streams.start(generators))
        return await streams.collect_last(merged, len(generators))

    completed, outputs = await streams.unless_disconnected(raw, final_outputs())
    if not completed or outputs is None:
        return Response(status_code=499)  # the client left; nobody reads this
    choices = [answer.final_choice(i, o, c) for i, o in enumerate(outputs) for c in o.outputs]
    choices.sort(key=lambda choice: choice.index)
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    usage = UsageInfo(**answer.usage(dict(enumerate(outputs)), generated))
    body = answer.final_body(choices, outputs, usage)
    return Response(body.model_dump_json(), media_type="application/json")


async def _stream(
    raw: Request,
    request: SamplingRequest,
    generators: list[AsyncGenerator[RequestOutput, None]],
    answer: Answer,
) -> StreamingResponse:
    options = request.stream_options
    include_usage = options is not None and options.include_usage
    continuous = options is not None and options.continuous_usage_stats
    chunk = streams.chunk_writer(answer.request_id, answer.object_name, answer.model)
    lengths = answer.prompt_lengths
    merged = streams.merge(await streams.start(generators))

    async def events() -> AsyncGenerator[bytes, None]:
        generated: dict[tuple[int, int], int] = {}  # (prompt, choice) -> its tokens so far
        last: dict[int, RequestOutput] = {}
        try:
            for n, choice in enumerate(answer.opening):
                usage = streams.usage(lengths[0], 0) if continuous else None
                yield chunk([choice], usage, answer.opening_fields if n == 0 else None)
            async for i, output in merged:
                last[i] = output
                fields = answer.output_fields(i, output) if answer.output_fields else None
                for c in output.outputs:
                    key = (i, c.index)
                    count = generated[key] = generated.get(key, 0) + len(c.token_ids)
                    usage = streams.usage(lengths[i], count) if continuous else None
                    yield chunk([answer.stream_choice(i, output, c)], usage, fields)
                    fields = None
            if include_usage:
                yield chunk([], answer.usage(last, sum(generated.values())))
        except Exception as exc:
            yield streams.error_event(exc, raw.state.request_id)
        finally:
            await merged.aclose()
        yield streams.DONE

    return StreamingResponse(events(), media_type="text/event-stream")
