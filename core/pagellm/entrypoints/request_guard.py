"""The ASGI middleware in front of every route of the API server (plugin routes included)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import uuid

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagellm.entrypoints.http_errors import APIError, bad_request, internal_error
from pagellm.entrypoints.server_args import API_KEY_ENV, ServerArgs

logger = logging.getLogger(__name__)

# The health checks, which load balancers send without credentials.
OPEN_PATHS = frozenset({"/health", "/health/", "/ping"})


def route_path(scope: Scope) -> str:
    """The path routes match: the request's, less the ``--root-path`` prefix uvicorn puts in
    front of it (ASGI's ``path`` includes ``root_path``)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class RequestGuard:
    """Request id, API key and body-size limit, in front of every route.

    The body is read here, up to the limit, and replayed to the app: a body that is too large is
    refused before any handler sees it, whether or not the client sent a Content-Length.
    """

    def __init__(self, app: ASGIApp, args: ServerArgs) -> None:
        self.app = app
        api_key = args.api_key or os.environ.get(API_KEY_ENV)
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = args.max_request_body_bytes
        self.body_timeout = args.body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        id_header = (b"x-request-id", request_id.encode("latin-1"))
        started = False

        # One wrapper of ``send`` (a stream calls it for every chunk): the request id on the
        # response's start, and whether the response has started.
        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", ()), id_header]
            await send(message)

        if route_path(scope) not in OPEN_PATHS and not self._authorized(headers):
            error = APIError(
                401,
                "Missing or wrong API key: send it as 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
            )
            await error.response()(scope, receive, send_with_id)
            return
        try:
            body = await asyncio.wait_for(self._read_body(headers, receive), self.body_timeout)
        except APIError as error:
            await error.response()(scope, receive, send_with_id)
            return
        except asyncio.TimeoutError:
            timeout = APIError(
                408,
                f"The request body did not arrive within {self.body_timeout:g} s.",
                code="request_timeout",
            )
            await timeout.response(headers={"Connection": "close"})(scope, receive, send_with_id)
            return
        if body is None:
            return  # the client left before sending its body

        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        try:
            await self.app(scope, replay, send_with_id)
        except Exception as exc:
            # Whatever no handler took: logged with the request id, answered without details
            # (and the connection stays usable: nothing reaches uvicorn).
            logger.error("Request %s failed", request_id, exc_info=exc)
            if not started:
                await internal_error(request_id).response()(scope, receive, send_with_id)

    def _authorized(self, headers: Headers) -> bool:
        if self.api_key is None:
            return True
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), self.api_key
        )

    async def _read_body(self, headers: Headers, receive: Receive) -> bytes | None:
        limit = self.max_body_bytes
        too_large = bad_request(
            f"The request body is larger than the server's limit of {limit} bytes.",
            code="request_too_large",
        )
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise bad_request(f"Invalid Content-Length header {declared!r}.")
            if int(declared) > limit:
                raise too_large
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
