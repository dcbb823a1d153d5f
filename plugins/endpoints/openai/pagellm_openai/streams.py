"""Driving the engine's output streams from a route: start them (so bad input is refused before a
response begins), merge several, stop when the client leaves, and frame Server-Sent Events.

Stopping is always by closing or cancelling the engine's generators: `AsyncLLM.generate` aborts its
request (and frees its KV blocks) when its consumer goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, Generic, TypeVar

import msgspec
from fastapi import Request
from pydantic import BaseModel

from pagellm.entrypoints.http_errors import bad_request, error_for

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

DONE = b"data: [DONE]\n\n"


# Characters that JSON leaves raw but that line readers built on str.splitlines() (httpx's among
# them) take for line ends: escaped, so a generated text containing one cannot cut an event.
_LINE_BREAKING = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _builtins(obj: object) -> object:
    if isinstance(obj, BaseModel):
        return obj.model_dump()
    raise NotImplementedError(f"cannot encode {type(obj).__name__} as JSON")


_encoder = msgspec.json.Encoder(enc_hook=_builtins)


def sse(event: BaseModel | dict) -> bytes:
    """One Server-Sent Event carrying ``event`` as JSON. Streams build their chunks as plain dicts
    (keys in the order of the response models): one msgspec encoding per chunk, no models."""
    payload = _encoder.encode(event)
    if b"\xc2\x85" in payload or b"\xe2\x80" in payload:  # U+0085, or U+2028/U+2029 maybe
        payload = payload.decode().translate(_LINE_BREAKING).encode()
    return b"data: " + payload + b"\n\n"


class TextChoice:
    """A stream choice in which only the text varies (no logprobs, token ids or finish reason):
    the route's ``render(index, text)`` makes it a dict, and its events are written from a byte
    template of that dict (`ChunkWriter.text`), the text alone encoded per chunk."""

    __slots__ = ("index", "text")

    def __init__(self, index: int, text: str) -> None:
        self.index = index
        self.text = text


_MARK = "\x00pagellm-text\x00"  # where a template's text goes; JSON writes it as \u0000...
_MARK_JSON = _encoder.encode(_MARK)


class ChunkWriter:
    """Frames one stream's chunks as events: the response's fields (``CompletionResponse``,
    ``ChatCompletionChunk``) as a dict, no model per chunk; ``created`` is the stream's start.
    A `TextChoice` chunk is a template's two ends around the encoded text: the same bytes as
    the dict, without building and encoding it for every token."""

    def __init__(self, request_id: str, object_name: str, model: str) -> None:
        self._head = {
            "id": request_id,
            "object": object_name,
            "created": int(time.time()),
            "model": model,
        }
        self._templates: dict[int, tuple[bytes, bytes]] = {}
        self._no_template: set[int] = set()

    def __call__(
        self,
        choices: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        fields: dict[str, Any] | None = None,
    ) -> bytes:
        """An event of ``choices``; ``fields``: more top-level fields (vLLM's
        ``prompt_token_ids``, ...)."""
        event = {**self._head, "choices": choices, "usage": usage}
        if fields:
            event.update(fields)
        return sse(event)

    def text(self, choice: TextChoice, render: Callable[[int, str], dict[str, Any]]) -> bytes:
        """The event of a text-only choice, ``render`` making its dict."""
        template = self._templates.get(choice.index) or self.template(choice.index, render)
        if template is None:
            return self([render(choice.index, choice.text)])
        return template[0] + json_text(choice.text) + template[1]

    def template(
        self, index: int, render: Callable[[int, str], dict[str, Any]]
    ) -> tuple[bytes, bytes] | None:
        """The two ends of choice ``index``'s text-only events, around the text's JSON; None when
        a field other than the text holds the mark (a model name, say): then every event is
        encoded whole."""
        if index in self._templates or index in self._no_template:
            return self._templates.get(index)
        parts = self([render(index, _MARK)]).split(_MARK_JSON)
        if len(parts) != 2:
            self._no_template.add(index)
            return None
        self._templates[index] = (parts[0], parts[1])
        return self._templates[index]


def json_text(text: str) -> bytes:
    """A string's JSON as `sse` writes it (line separators escaped)."""
    payload = _encoder.encode(text)
    if b"\xc2\x85" in payload or b"\xe2\x80" in payload:  # U+0085, or U+2028/U+2029 maybe
        payload = payload.decode().translate(_LINE_BREAKING).encode()
    return payload


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> dict[str, Any]:
    """`UsageInfo`'s fields, as a dict (for stream chunks); ``prompt_tokens_details`` only with
    ``cached_tokens``."""
    fields: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        fields["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return fields


class Started(Generic[T]):
    """An engine output stream whose first item has already been received: ``first`` (None if
    the stream ended without any), then the items of ``rest``."""

    def __init__(self, first: T | None, rest: AsyncGenerator[T, None]) -> None:
        self.first = first
        self.rest = rest

    async def items(self) -> AsyncGenerator[T, None]:
        if self.first is not None:
            yield self.first
        async for item in self.rest:
            yield item

    async def aclose(self) -> None:
        await self.rest.aclose()


async def start(generators: list[AsyncGenerator[T, None]]) -> list[Started[T]]:
    """Wait for every generator's first item, so the engine has accepted every request (it refuses
    bad input with ``ValueError`` before its first output: answered with a 400). On any error
    every generator is closed (its request aborted) and the first error raised."""
    firsts = await asyncio.gather(*(anext(g) for g in generators), return_exceptions=True)
    error = next(
        (
            r
            for r in firsts
            if isinstance(r, BaseException) and not isinstance(r, StopAsyncIteration)
        ),
        None,
    )
    if error is not None:
        for g in generators:
            await g.aclose()
        if isinstance(error, ValueError):
            raise bad_request(str(error), param=getattr(error, "param", None)) from error
        raise error
    return [
        Started(None if isinstance(first, StopAsyncIteration) else first, g)  # type: ignore[arg-type]
        for first, g in zip(firsts, generators, strict=True)
    ]


async def merge(iterators: list[Started[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """Items of several iterators as they come, each tagged with its iterator's index. Closing
    the merged stream (or cancelling its consumer) cancels and closes every source."""
    sources = [it.items() for it in iterators]
    pending: dict[asyncio.Future[T], int] = {
        asyncio.ensure_future(anext(source)): i for i, source in enumerate(sources)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(sources[i]))] = i
                yield i, item
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for source in sources:
            await source.aclose()
        for it in iterators:
            await it.aclose()


def error_event(exc: Exception, request_id: str) -> bytes:
    """The event that ends a stream whose request failed after the response began (its status,
    200, is already sent): an OpenAI-style error, which OpenAI clients raise. What went wrong
    inside is logged with the request id; the client gets the id, not the details."""
    error = error_for(exc, request_id)
    if error.status == 500:  # not the engine's state: a failure to look into
        logger.error("Streamed request %s failed", request_id, exc_info=exc)
    return sse(error.body())


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[R]) -> tuple[bool, R | None]:
    """Run ``work``, cancelling it if the client disconnects first (a non-streaming request would
    otherwise run to its end for nobody). Returns (completed, result)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return False, None
    return True, task.result()


async def collect_last(iterator: AsyncIterator[tuple[int, T]], count: int) -> list[T]:
    """The last item of each of ``count`` merged sources (their final outputs)."""
    last: dict[int, T] = {}
    async for i, item in iterator:
        last[i] = item
    return [last[i] for i in range(count)]
