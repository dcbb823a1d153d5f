"""`EventStream`: a Server-Sent Events response that a coroutine writes chunk by chunk.

Starlette's ``StreamingResponse`` pulls every chunk out of an async generator and passes it to
``send`` through each middleware's wrapper: a token stream pays both for every token. Here the
route's coroutine writes its chunks itself, the body through the server's own ``send``
(`BODY_SEND`; the start goes through the app's, which every middleware sees), and the client's
disconnect cancels it (uvicorn's ASGI 2.3 ``send`` does not raise once the client is gone), which
aborts its engine requests.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pagellm.entrypoints.http_server import BODY_SEND
from pagellm_openai.streams import unless_disconnected

EventWriter = Callable[[bytes], Awaitable[None]]
"""Sends some events (one or more, framed) as the next piece of the body."""


class EventStream(Response):
    """``write_events(write)`` writes the events and returns the stream's last bytes (sent as
    the end of the body)."""

    media_type = "text/event-stream"

    def __init__(
        self, request: Request, write_events: Callable[[EventWriter], Awaitable[bytes]]
    ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers()
        self._request = request
        self._write_events = write_events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
        await send(start)
        body_send: Send = scope.get(BODY_SEND, send)

        def write(data: bytes) -> Awaitable[None]:  # no frame of its own: send's coroutine
            return body_send({"type": "http.response.body", "body": data, "more_body": True})

        completed, end = await unless_disconnected(self._request, self._write_events(write))
        if completed:
            await body_send({"type": "http.response.body", "body": end, "more_body": False})
