"""Endpoint plugin: routes for the API server, for models that generate text."""

from typing import Any

from pagellm.plugins import EndpointPlugin, hookimpl

pagellm_plugin_api = "1.0"


def attach(app: Any, engine_client: Any) -> None:
    @app.get("/v1/dummy/ping")
    def ping() -> dict[str, str]:
        # A 1.0 plugin reads what it needs from app.state (1.1: from its ServerContext).
        return {"pong": "dummy", "model": app.state.served_model_names[0]}


@hookimpl
def pagellm_endpoint() -> EndpointPlugin:
    return EndpointPlugin(
        attach=attach, required_tasks=frozenset({"generate"}), description="ping route"
    )
