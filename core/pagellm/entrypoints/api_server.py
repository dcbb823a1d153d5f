"""The API server: a FastAPI app around one `AsyncLLM`, served by uvicorn (`pagellm serve MODEL`).

The core serves only ``/health``, ``/version`` and ``/metrics``; every other route comes from the
endpoint plugins the server is allowed to load (deny by default: VLLM_PLUGINS when it is set, else
``--endpoints``), whose ``required_tasks`` the served model must meet. One ASGI middleware in front of
every route (plugin routes included, `request_guard.RequestGuard`) gives each request an id
(``X-Request-Id``, echoed or made), checks the API key (everywhere but ``/health``), refuses bodies
over ``--max-request-body-bytes`` or slower than ``--body-timeout``, and answers what no handler
took with a generic 500 (`http_errors`). uvicorn's side (header timeout, shutdown deadline) is
`http_server`.

Plugins find what they need on ``app.state``: ``engine_client`` (the `AsyncLLM`),
``served_model_names`` (the names clients may ask for; the first is the one reported) and
``model_path``; a request's id is ``request.state.request_id``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from pagellm.entrypoints.http_errors import SERVER_ERROR, APIError, install_error_handlers
from pagellm.entrypoints.request_guard import DEFAULT_BODY_TIMEOUT_S, RequestGuard
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
API_KEY_ENV = "PAGELLM_API_KEY"


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
    install_error_handlers(app)

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
        RequestGuard, api_key=api_key, max_body_bytes=max_body, body_timeout=body_timeout
    )
    return app


async def _serve(args: argparse.Namespace) -> None:
    from pagellm.engine.args import EngineArgs
    from pagellm.engine.async_llm import AsyncLLM
    from pagellm.engine.errors import EngineShuttingDownError
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
