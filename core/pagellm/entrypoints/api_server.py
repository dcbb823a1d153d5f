"""The API server: a FastAPI app around one `AsyncLLM`, served by uvicorn (`pagellm serve MODEL`).

The core serves only ``/health`` (also as ``/health/`` and ``/ping``), ``/version`` and
``/metrics``; every other route comes from the endpoint plugins the server is allowed to load (deny
by default: VLLM_PLUGINS when it is set, else ``--endpoints``), whose ``required_tasks`` the
served model must meet (its runner's tasks: ``generate``, or ``embed`` for a pooling model); each
plugin's ``attach`` gets the app and a `ServerContext`. In front of
every route: `request_guard`; error bodies: `http_errors`; uvicorn's side (header timeout,
shutdown deadline): `http_server`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.middleware.cors import CORSMiddleware

from pagellm.entrypoints.http_errors import SERVER_ERROR, APIError, install_error_handlers
from pagellm.entrypoints.request_guard import RequestGuard
from pagellm.entrypoints.server_args import DEFAULT_ENDPOINTS, ServerArgs
from pagellm.entrypoints.server_context import ServerContext
from pagellm.plugins import EndpointPlugin, allowlist, groups, load_endpoint_plugins
from pagellm.plugins.loader import PluginError, discover, strict_mode
from pagellm.version import __version__

if TYPE_CHECKING:
    from pagellm.engine.args import EngineArgs
    from pagellm.engine.async_llm import AsyncLLM
    from pagellm.metrics.stats import StatLoggerBase

logger = logging.getLogger(__name__)


def _endpoint_names(args: ServerArgs) -> list[str]:
    names = list(args.endpoints)
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
    if tuple(names) == DEFAULT_ENDPOINTS:  # one per kind of model: not all need be installed
        missing = [name for name in missing if name == DEFAULT_ENDPOINTS[0]]
    if missing:
        logger.warning(
            "--endpoints names endpoint plugins that are not installed: %s (installed: %s)",
            ", ".join(missing),
            ", ".join(sorted(installed)) or "none",
        )
    return names


def attach_endpoint_plugin(app: FastAPI, plugin: EndpointPlugin, ctx: ServerContext) -> None:
    """Add one plugin's routes: ``attach(app, ctx)``, or for plugin API 1.0
    ``attach(app, engine_client)`` with the ``app.state`` keys 1.0 plugins read."""
    if plugin.api_version != "1.0":
        plugin.attach(app, ctx)
        return
    app.state.engine_client = ctx.engine_client
    app.state.model_path = ctx.model_path
    app.state.served_model_names = ctx.served_model_names
    app.state.max_sequences_per_request = ctx.args.max_sequences_per_request
    plugin.attach(app, ctx.engine_client)


def _attach_endpoint_plugins(app: FastAPI, ctx: ServerContext) -> None:
    """The allowed plugins whose required tasks the model has (`ModelConfig.tasks`); those left
    out for their tasks are named by the 404 of a route nobody serves."""
    tasks = set(ctx.engine_client.config.model.tasks)
    skipped: dict[str, str] = {}
    enabled = load_endpoint_plugins(_endpoint_names(ctx.args), tasks, skipped)
    app.state.endpoints_not_served = skipped
    for name, plugin in enabled:
        try:
            attach_endpoint_plugin(app, plugin, ctx)
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
            "No endpoint plugin is enabled: only /health, /ping, /version and /metrics are served."
        )


def build_app(engine: AsyncLLM, args: ServerArgs, stat_loggers: list[StatLoggerBase]) -> FastAPI:
    """The app serving ``engine`` (which reports to ``stat_loggers``): core routes, then the
    allowed endpoint plugins' routes. The app owns the engine: when it shuts down (after uvicorn's
    graceful shutdown), it gives the engine what is left until ``app.state.shutdown_deadline``."""
    from pagellm.metrics.prometheus import PrometheusStatLogger, metrics_response
    from pagellm.platforms import current_platform_name

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            logger.info("Shutting the engine down")
            deadline: float | None = app.state.shutdown_deadline
            loop = asyncio.get_running_loop()
            remaining = 1.0 if deadline is None else deadline - loop.time()
            await engine.shutdown_async(max(0.1, remaining))

    docs: dict[str, Any] = (
        {"docs_url": None, "redoc_url": None, "openapi_url": None}
        if args.disable_fastapi_docs
        else {}
    )
    app = FastAPI(title="pagellm", version=__version__, lifespan=lifespan, **docs)
    app.state.shutdown_deadline = None
    install_error_handlers(app)

    # /ping is SageMaker's name for it (GET or POST); all three are open without the API key.
    @app.get("/health")
    @app.get("/health/", include_in_schema=False)
    @app.api_route("/ping", methods=["GET", "POST"])
    async def health() -> Response:
        try:
            engine.check_health()
        except Exception as exc:
            return APIError(503, f"Unhealthy: {exc}", type=SERVER_ERROR).response()
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    prometheus = [s for s in stat_loggers if isinstance(s, PrometheusStatLogger)]
    if prometheus:

        @app.get("/metrics")
        async def serve_metrics() -> Response:
            body, content_type = metrics_response(prometheus[0])
            return Response(body, media_type=content_type)

    ctx = ServerContext(
        engine_client=engine,
        served_model_names=args.served_model_names,
        model_path=engine.config.model.model,
        platform_name=current_platform_name(),
        stat_loggers=stat_loggers,
        args=args,
    )
    _attach_endpoint_plugins(app, ctx)
    app.add_middleware(RequestGuard, args=args)
    # Outermost: a browser's preflight (OPTIONS) is answered here, before the API key's check,
    # and every response, a 401 too, carries the CORS headers the browser needs to read it.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(args.allowed_origins),
        allow_methods=list(args.allowed_methods),
        allow_headers=list(args.allowed_headers),
        allow_credentials=args.allow_credentials,
    )
    return app


async def _serve(args: ServerArgs, engine_args: EngineArgs) -> None:
    from pagellm.engine.async_llm import AsyncLLM
    from pagellm.engine.errors import EngineShuttingDownError
    from pagellm.entrypoints.http_server import make_server, shutdown_margin, shutdown_timeout
    from pagellm.metrics.loggers import build_stat_loggers

    stat_loggers = build_stat_loggers(
        args.served_model_names[0], list(args.stat_loggers), not args.disable_log_stats
    )
    engine = AsyncLLM.from_engine_args(
        engine_args,
        stat_loggers,
        args.max_waiting_requests or None,
        log_requests=args.enable_log_requests,
    )
    for child in multiprocessing.active_children():  # for operators (and tests) that need the pid
        logger.info("Engine process %s: pid %d", child.name, child.pid)
    try:
        app = build_app(engine, args, stat_loggers)
    except BaseException:
        engine.shutdown()
        raise
    timeout = shutdown_timeout(args)

    def on_shutdown() -> None:
        loop = asyncio.get_running_loop()
        app.state.shutdown_deadline = loop.time() + timeout
        error = EngineShuttingDownError("The server is shutting down; retry on another server.")
        loop.call_later(timeout - shutdown_margin(timeout), engine.fail_all, error)

    server = make_server(app, args, on_shutdown)
    # What is built by now (the app, the tokenizer, every import) lives as long as the server:
    # out of the garbage collector's full scans, which the objects of streamed tokens set off.
    gc.collect()
    gc.freeze()
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


def run_server(args: ServerArgs, engine_args: EngineArgs) -> None:
    """Build the engine and serve it until SIGTERM/SIGINT (``pagellm serve``)."""
    args.check_tls()  # before the engine is built: a typo costs no model load
    factory = _loop_factory()
    if factory is None or sys.version_info < (3, 11):
        asyncio.run(_serve(args, engine_args))
        return
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(_serve(args, engine_args))
