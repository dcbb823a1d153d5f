"""Endpoint plugin whose routes need an embedding model: skipped for generative models."""

from typing import Any

from pagellm.plugins import EndpointPlugin, hookimpl

pagellm_plugin_api = "1.0"


def attach(app: Any, engine_client: Any) -> None:
    @app.post("/v1/dummy/embed")
    def embed() -> dict[str, list[float]]:
        return {"embedding": []}


@hookimpl
def pagellm_endpoint() -> EndpointPlugin:
    return EndpointPlugin(
        attach=attach, required_tasks=frozenset({"embed"}), description="embedding route"
    )
