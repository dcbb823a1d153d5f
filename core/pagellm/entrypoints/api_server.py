"""The API server: a FastAPI app around one `AsyncLLM`, served by uvicorn (`pagellm serve MODEL`).

The core serves only ``/health``, ``/version`` and ``/metrics``; every other route comes from the
endpoint plugins the server is allowed to load (deny by default: VLLM_PLUGINS when it is set, else
``--endpoints``), whose ``required_tasks`` the served model must meet. One ASGI middleware in front of
every route (plugin routes included) gives each request an id (``X-Request-Id``, echoed or made),
checks the API key (everywhere but ``/health``) and refuses bodies over ``--max-request-body-bytes``.

Plugins find what they need on ``app.state``: ``engine_client`` (the `AsyncLLM`),
``served_model_names`` (the names clients may ask for; the first is the one reported) and
``model_path``; a request's id is ``request.state.request_id``.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import multiprocessing
import os
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagellm.entrypoints.http_errors import SERVER_ERROR, APIError, bad_request
from pagellm.plugins import allowlist, groups, load_endpoint_plugins
from pagellm.plugins.loader import PluginError, discover, strict_mode
from pagellm.version import __version__

if TYPE_CHECKING:
    from pagellm.engine.async_llm import AsyncLLM
    from pagellm.metrics.loggers import PrometheusStatLogger

logger = logging.getLogger(__name__)

# What every model pagellm serves can do. Models of other tasks (embeddings, ...) do not exist yet.
SERVED_TASKS = frozenset({"generate"})
DEFAULT_MAX_REQUEST_BODY_BYTES = 1 << 20
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 256
DEFAULT_MAX_WAITING_REQUESTS = 1024
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
RETRY_AFTER_S = 1
API_KEY_ENV = "PAGELLM_API_KEY"
OPEN_PATHS = frozenset({"/health"})


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``pagellm serve`` other than the engine's."""
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"Require 'Authorization: Bearer KEY' on every route but /health (default: ${API_KEY_ENV}).",
    )
    parser.add_argument(
        "--endpoints",
        default="openai",
        help="Comma-separated endpoint plugins to serve when VLLM_PLUGINS is unset "
        "(when it is set, it alone decides).",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="Model name(s) clients use in requests (default: the model argument).",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="Larger request bodies are refused with HTTP 400.",
    )
    parser.add_argument(
        "--stat-loggers",
        default="",
        help="Comma-separated stat loggers of pagellm.stat_logger_plugins to add to the built-in "
        "ones (the periodic log line and Prometheus /metrics, always on).",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5,
        help="On SIGTERM/SIGINT, seconds until the process exits: in-flight requests may finish "
        "until shortly before; those still running then end with an error (a stream with an "
        "error event and [DONE]).",
    )
    parser.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=DEFAULT_MAX_SEQUENCES_PER_REQUEST,
        help="Most sequences one HTTP request may ask for (prompts × n); more get HTTP 400.",
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=DEFAULT_MAX_WAITING_REQUESTS,
        help="Most sequences that may wait for the engine beyond those it runs; past it, requests "
        "get HTTP 503 with Retry-After (0: no limit).",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="Seconds a connection may take to send a request's headers before it is closed.",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="Seconds a request may take to send its body before it gets HTTP 408.",
    )
    parser.add_argument(
        "--disable-fastapi-docs",
        action="store_true",
        help="Serve no /docs, /redoc or /openapi.json.",
    )


class _RequestGuard:
    """Request id, API key and body-size limit, in front of every route.

    The body is read here, up to the limit, and replayed to the app: a body that is too large is
    refused before any handler sees it, whether or not the client sent a Content-Length.
    """

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body_bytes: int,
        body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        id_header = (b"x-request-id", request_id.encode("latin-1"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), id_header]
            await send(message)

        if scope["path"] not in OPEN_PATHS and not self._authorized(headers):
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

        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send_with_id(message)

        try:
            await self.app(scope, replay, send_tracked)
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


def _validation_error(exc: RequestValidationError) -> APIError:
    """A 400 naming the offending top-level field as ``param`` (``messages``, ``n``) and its full
    location in the message."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return bad_request(
            f"The request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
        )
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    message = first.get("msg", "Invalid request.")
    if loc:
        message = f"{'.'.join(loc)}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return bad_request(message, param=loc[0] if loc else None)


def _request_id(request: Request) -> str:
    return str(getattr(request.state, "request_id", "") or "unknown")


def internal_error(request_id: str, status: int = 500, code: str | None = None) -> APIError:
    """What a client learns of a failure inside the server: that it happened, and the id to
    find it in the server's log (where its details are)."""
    return APIError(
        status,
        f"The server failed to handle the request (request id {request_id}); "
        "its log has the details.",
        type=SERVER_ERROR,
        code=code,
    )


def _install_error_handlers(app: FastAPI) -> None:
    from pagellm.engine.async_llm import EngineOverloadedError, EngineShuttingDownError
    from pagellm.engine.core_client import EngineDeadError

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return exc.response()

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return _validation_error(exc).response()

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        error = APIError(exc.status_code, str(exc.detail))
        return error.response(headers=dict(exc.headers or {}))

    async def engine_dead(request: Request, exc: Exception) -> Response:
        return APIError(
            503,
            "The engine has stopped (request id "
            f"{_request_id(request)}); the server must be restarted.",
            type=SERVER_ERROR,
            code="engine_dead",
        ).response()

    async def unavailable(request: Request, exc: Exception) -> Response:
        overloaded = isinstance(exc, EngineOverloadedError)
        error = APIError(
            503,
            str(exc),
            type=SERVER_ERROR,
            code="server_overloaded" if overloaded else "server_shutting_down",
        )
        return error.response(headers={"Retry-After": str(RETRY_AFTER_S)} if overloaded else None)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(EngineDeadError, engine_dead)
    app.add_exception_handler(EngineOverloadedError, unavailable)
    app.add_exception_handler(EngineShuttingDownError, unavailable)


def _endpoint_names(args: argparse.Namespace) -> list[str]:
    names = [n.strip() for n in (getattr(args, "endpoints", None) or "").split(",") if n.strip()]
    if allowlist() is not None:
        if names:
            logger.info(
                "VLLM_PLUGINS is set: it alone chooses the endpoint plugins "
                "(--endpoints %s ignored).",
                ",".join(names),
            )
        return names
    installed = {ep.name for ep in discover(groups.ENDPOINT)}
    missing = sorted(set(names) - installed)
    if missing:
        logger.warning(
            "--endpoints names endpoint plugins that are not installed: %s (installed: %s)",
            ", ".join(missing),
            ", ".join(sorted(installed)) or "none",
        )
    return names


def _attach_endpoint_plugins(app: FastAPI, engine_client: Any, args: argparse.Namespace) -> None:
    enabled = load_endpoint_plugins(_endpoint_names(args), served_tasks=set(SERVED_TASKS))
    for name, plugin in enabled:
        try:
            plugin.attach(app, engine_client)
        except Exception as exc:
            if strict_mode():
                raise PluginError(
                    f"endpoint plugin {name!r} failed to attach its routes: {exc}"
                ) from exc
            logger.exception("Endpoint plugin %r failed to attach its routes; not served", name)
            continue
        logger.info("Serving endpoint plugin %r", name)
    if not enabled:
        logger.warning(
            "No endpoint plugin is enabled: only /health, /version and /metrics are served."
        )


def build_app(
    engine_client: AsyncLLM,
    args: argparse.Namespace,
    *,
    metrics: PrometheusStatLogger | None = None,
) -> FastAPI:
    """The app serving ``engine_client``: core routes, then the allowed endpoint plugins' routes.

    The app owns the engine for its lifetime: when the app shuts down (after uvicorn's graceful
    shutdown has let in-flight requests finish or cancelled them), it shuts the engine down.
    ``metrics``: the Prometheus stat logger the engine reports to, served at ``/metrics``.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            logger.info("Shutting the engine down")
            deadline: float | None = getattr(app.state, "shutdown_deadline", None)
            loop = asyncio.get_running_loop()
            remaining = 1.0 if deadline is None else deadline - loop.time()
            await engine_client.shutdown_async(max(0.1, remaining))

    docs: dict[str, Any] = (
        {"docs_url": None, "redoc_url": None, "openapi_url": None}
        if getattr(args, "disable_fastapi_docs", False)
        else {}
    )
    app = FastAPI(title="pagellm", version=__version__, lifespan=lifespan, **docs)
    model_path = engine_client.config.model.model
    app.state.engine_client = engine_client
    app.state.model_path = model_path
    app.state.served_model_names = list(getattr(args, "served_model_name", None) or [model_path])
    app.state.max_sequences_per_request = getattr(
        args, "max_sequences_per_request", DEFAULT_MAX_SEQUENCES_PER_REQUEST
    )
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        try:
            engine_client.check_health()
        except Exception as exc:
            return APIError(503, f"Unhealthy: {exc}", type=SERVER_ERROR).response()
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    if metrics is not None:
        from pagellm.metrics.loggers import metrics_response

        prometheus = metrics

        @app.get("/metrics")
        async def serve_metrics() -> Response:
            body, content_type = metrics_response(prometheus)
            return Response(body, media_type=content_type)

    _attach_endpoint_plugins(app, engine_client, args)
    api_key = getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None
    max_body = getattr(args, "max_request_body_bytes", DEFAULT_MAX_REQUEST_BODY_BYTES)
    body_timeout = getattr(args, "body_timeout", DEFAULT_BODY_TIMEOUT_S)
    app.add_middleware(
        _RequestGuard, api_key=api_key, max_body_bytes=max_body, body_timeout=body_timeout
    )
    return app


async def _serve(args: argparse.Namespace) -> None:
    from pagellm.engine.args import EngineArgs
    from pagellm.engine.async_llm import AsyncLLM, EngineShuttingDownError
    from pagellm.entrypoints.http_server import make_server, shutdown_margin
    from pagellm.metrics.loggers import PrometheusStatLogger, build_stat_loggers

    served_name = (args.served_model_name or [args.model])[0]
    plugin_loggers = [n.strip() for n in args.stat_loggers.split(",") if n.strip()]
    stat_loggers = build_stat_loggers(served_name, plugin_loggers)
    prometheus = next(s for s in stat_loggers if isinstance(s, PrometheusStatLogger))
    engine = AsyncLLM.from_engine_args(
        EngineArgs.from_cli_args(args),
        stat_loggers=stat_loggers,
        max_waiting_requests=args.max_waiting_requests or None,
    )
    for child in multiprocessing.active_children():  # for operators (and tests) that need the pid
        logger.info("Engine process %s: pid %d", child.name, child.pid)
    try:
        app = build_app(engine, args, metrics=prometheus)
    except BaseException:
        engine.shutdown()
        raise
    timeout = max(0.0, args.shutdown_timeout)

    def on_shutdown() -> None:
        loop = asyncio.get_running_loop()
        app.state.shutdown_deadline = loop.time() + timeout
        error = EngineShuttingDownError("The server is shutting down; retry on another server.")
        loop.call_later(timeout - shutdown_margin(timeout), engine.fail_all, error)

    server = make_server(
        app,
        host=args.host,
        port=args.port,
        header_timeout=args.header_timeout,
        shutdown_timeout=timeout,
        on_shutdown=on_shutdown,
    )
    # From here the app's lifespan owns the engine: uvicorn runs it even when it fails to bind.
    await server.serve()


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (the front end's per-token work runs on it),
    else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run_server(args: argparse.Namespace) -> None:
    """Build the engine and serve it until SIGTERM/SIGINT (``pagellm serve``)."""
    logging.getLogger("uvicorn.error").setLevel(logging.INFO)
    factory = _loop_factory()
    if factory is None or sys.version_info < (3, 11):
        asyncio.run(_serve(args))
        return
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(_serve(args))
