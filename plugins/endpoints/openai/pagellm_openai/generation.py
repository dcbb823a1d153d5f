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
from fastapi.responses import Response
from pydantic import BaseModel

from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm_openai import streams
from pagellm_openai.event_stream import EventStream, EventWriter
from pagellm_openai.protocol import SamplingRequest
from pagellm_openai.responses import UsageInfo

# (index of the prompt, its output, one completion of it) -> a choice (a dict, a TextChoice, or
# the final body's model)
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
    text_choice: Callable[[int, str], dict[str, Any]] | None = None
    """The dict of a `streams.TextChoice` (index, text), which ``stream_choice`` may return for
    a choice whose chunk varies only by its text: such chunks are written from a template."""
    text_only: bool = False
    """One prompt, one choice (index 0), and every chunk after its first output's, until it
    finishes, is ``text_choice(0, text)``: a stream then skips ``stream_choice`` for them."""

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
) -> Response:
    options = request.stream_options
    include_usage = options is not None and options.include_usage
    continuous = options is not None and options.continuous_usage_stats
    chunk = streams.ChunkWriter(answer.request_id, answer.object_name, answer.model)
    lengths = answer.prompt_lengths
    sources = await streams.start(generators)
    stream_choice, text_choice, output_fields = (
        answer.stream_choice,
        answer.text_choice,
        answer.output_fields,
    )
    text = chunk.text if text_choice is not None and not continuous else None
    generated: dict[tuple[int, int], int] = {}  # (prompt, choice) -> its tokens so far
    last: dict[int, RequestOutput] = {}

    def events(i: int, output: RequestOutput) -> bytes:
        """The events of one output: a chunk per completion in it (a streamed token's path:
        kept short)."""
        last[i] = output
        fields = output_fields(i, output) if output_fields else None
        batch = []
        for c in output.outputs:
            key = (i, c.index)
            count = generated[key] = generated.get(key, 0) + len(c.token_ids)
            choice = stream_choice(i, output, c)
            if type(choice) is streams.TextChoice:
                if text is not None and not fields:
                    batch.append(text(choice, text_choice))  # type: ignore[arg-type]
                    continue
                choice = text_choice(choice.index, choice.text)  # type: ignore[misc]
            usage = streams.usage(lengths[i], count) if continuous else None
            batch.append(chunk([choice], usage, fields))
            fields = None
        return batch[0] if len(batch) == 1 else b"".join(batch)

    async def write_events(write: EventWriter) -> bytes:
        """Each output's events in one write (the one source read directly, the usual case);
        returns the end: usage when asked (or the error event), then ``[DONE]``."""
        end: list[bytes] = []
        streamed = 0  # the tokens of the chunks written from the template
        json_text = streams.json_text
        try:
            opening = [
                chunk(
                    [choice],
                    streams.usage(lengths[0], 0) if continuous else None,
                    answer.opening_fields if n == 0 else None,
                )
                for n, choice in enumerate(answer.opening)
            ]
            if opening:
                await write(b"".join(opening))
            if len(sources) == 1:
                source = sources[0]
                data = events(0, source.first) if source.first is not None else b""
                if data:
                    await write(data)
                template = (
                    chunk.template(0, text_choice)  # type: ignore[arg-type]
                    if answer.text_only and text is not None
                    else None
                )
                async for output in source.rest:
                    outputs = output.outputs
                    if template is not None and len(outputs) == 1:
                        c = outputs[0]
                        if c.finish_reason is None:  # a streamed token's path: text alone
                            streamed += len(c.token_ids)
                            await write(template[0] + json_text(c.text) + template[1])
                            continue
                    data = events(0, output)
                    if data:
                        await write(data)
            else:
                async for i, output in streams.merge(sources):
                    data = events(i, output)
                    if data:
                        await write(data)
            if include_usage:
                end.append(chunk([], answer.usage(last, sum(generated.values()) + streamed)))
        except Exception as exc:
            end.append(streams.error_event(exc, raw.state.request_id))
        finally:
            for source in sources:
                await source.aclose()
        end.append(streams.DONE)
        return b"".join(end)

    return EventStream(raw, write_events)
