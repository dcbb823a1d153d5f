"""The HTTP server under the API server's app: uvicorn, with a header timeout on every connection
and a shutdown that keeps to its deadline.

Header timeout: a connection has ``header_timeout`` seconds from its start (and, kept alive, from
the first byte of each later request) to send a request's headers, or it is closed; idle or
trickling connections cannot pile up. (The body has its own timeout, in the request guard.)

Shutdown (SIGTERM/SIGINT), within ``shutdown_timeout`` seconds of the signal: new connections are
refused at once and in-flight requests may finish; shortly before the deadline, those still
running are ended with `EngineShuttingDownError` (a stream gets an error event and ``[DONE]``, an
unstreamed request a 503); a moment later uvicorn cancels whatever could not even be written (a
client that stopped reading); the rest of the time is the engine process's to stop.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

import uvicorn

from pagellm.entrypoints.server_args import ServerArgs

logger = logging.getLogger(__name__)


def shutdown_timeout(args: ServerArgs) -> float:
    return max(0.0, args.shutdown_timeout)


def shutdown_margin(timeout: float) -> float:
    """How long before the deadline running requests are ended (the engine stops in the second
    half of it)."""
    return min(1.0, timeout / 4)


def timed_protocol_class(header_timeout: float) -> type[asyncio.Protocol] | None:
    """uvicorn's httptools protocol with the header timeout (None when httptools is missing)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        logger.warning("httptools is not installed: connections have no header timeout")
        return None

    class TimedHttpToolsProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout, self._timed_out)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _timed_out(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.logger.info("Closing a connection that sent no headers in %gs", header_timeout)
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return TimedHttpToolsProtocol


class Server(uvicorn.Server):
    """uvicorn's server, telling ``on_shutdown`` the moment its graceful shutdown begins."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)


BODY_SEND = "pagellm.body_send"
"""The scope key of the server's own ``send`` (uvicorn's), for a long stream's body chunks: they
skip the middlewares' wrappers of ``send`` (Starlette's error handlers, the request guard), which
only look at a response's start, and a token stream would otherwise go through each for every
token. The start must go through the ``send`` the response was given, so every middleware sees
it; a middleware that rewrites bodies would be skipped (none here does)."""


class _WithBodySend:
    """The app, with `BODY_SEND` in every HTTP scope."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope[BODY_SEND] = send
        await self.app(scope, receive, send)


def make_server(app: Any, args: ServerArgs, on_shutdown: Callable[[], None]) -> Server:
    protocol = timed_protocol_class(args.header_timeout)
    timeout = shutdown_timeout(args)
    # uvicorn waits with asyncio.wait_for, which takes fractions of a second too.
    graceful: Any = max(0.0, timeout - shutdown_margin(timeout) / 2)
    config = uvicorn.Config(
        _WithBodySend(app),
        host=args.host,
        port=args.port,
        log_config=None,  # the process's logging; uvicorn only sets its loggers' levels
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        root_path=args.root_path or "",
        http=protocol if protocol is not None else "auto",
        timeout_graceful_shutdown=graceful,
    )
    return Server(config, on_shutdown)
