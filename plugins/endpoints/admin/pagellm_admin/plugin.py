"""The ``admin`` endpoint plugin: ``GET /v1/admin/state`` and ``POST /v1/admin/reset_prefix_cache``,
through the engine's utility calls. Like every endpoint plugin it is served only when named
(VLLM_PLUGINS, or ``pagellm serve --endpoints openai,admin``)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from pagellm.entrypoints.server_context import ServerContext
from pagellm.plugins import EndpointPlugin, hookimpl

pagellm_plugin_api = "1.1"


class EngineState(BaseModel):
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    """Fraction of the KV cache's blocks in use (0 to 1)."""
    prefix_cache_hit_rate: float
    """Prompt tokens found in the prefix cache over those looked up, since the engine started."""


class ResetResult(BaseModel):
    reset: bool
    """False when blocks were in use by running requests, so the cache was left as it was."""


def attach(app: FastAPI, server: ServerContext) -> None:
    engine_client = server.engine_client

    @app.get("/v1/admin/state")
    async def state() -> dict[str, Any]:
        # Validated for the documented fields; anything more the engine reports passes through.
        raw = await engine_client.get_engine_state()
        return {**raw, **EngineState.model_validate(raw).model_dump()}

    @app.post("/v1/admin/reset_prefix_cache")
    async def reset_prefix_cache() -> ResetResult:
        return ResetResult(reset=bool(await engine_client.reset_prefix_cache()))


@hookimpl
def pagellm_endpoint() -> EndpointPlugin:
    return EndpointPlugin(
        attach=attach, required_tasks=None, description="engine state, prefix-cache reset"
    )
