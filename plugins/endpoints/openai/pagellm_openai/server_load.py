"""``GET /load``: the generation requests in flight, as vLLM's ``--enable-server-load-tracking``
reports them (here always on: counting costs an addition per request)."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from pagellm.entrypoints.request_guard import route_path


class InFlight:
    """The requests in flight on the counted routes."""

    def __init__(self) -> None:
        self.count = 0


class CountInFlight:
    """ASGI middleware: a request to one of ``paths`` counts from its arrival until its response
    (a stream's last byte) is sent or abandoned."""

    def __init__(self, app: ASGIApp, paths: frozenset[str], in_flight: InFlight) -> None:
        self.app = app
        self.paths = paths
        self.in_flight = in_flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) not in self.paths:
            await self.app(scope, receive, send)
            return
        self.in_flight.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight.count -= 1
