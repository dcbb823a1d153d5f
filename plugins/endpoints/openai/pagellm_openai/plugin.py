"""The ``openai`` endpoint plugin: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
``/invocations`` (SageMaker's: either of the two, by the body's shape), ``/tokenize``,
``/detokenize`` and ``/load``, for models that generate text."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response

from pagellm.entrypoints.http_errors import bad_request
from pagellm.entrypoints.server_context import ServerContext
from pagellm.plugins import EndpointPlugin, hookimpl
from pagellm_openai import tokenization
from pagellm_openai.bodies import json_body, keys, validated
from pagellm_openai.chat import create_chat_completion
from pagellm_openai.completions import create_completion
from pagellm_openai.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest
from pagellm_openai.responses import ModelCard, ModelList, ServerLoad
from pagellm_openai.server_load import CountInFlight, InFlight
from pagellm_openai.serving import ServingContext

pagellm_plugin_api = "1.1"

# The routes that run the engine: what GET /load counts.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/invocations"})


def _json(body: Any) -> Response:
    return Response(body.model_dump_json(), media_type="application/json")


def attach(app: FastAPI, server: ServerContext) -> None:
    ctx = ServingContext.from_server(server)
    in_flight = InFlight()
    app.add_middleware(CountInFlight, paths=GENERATION_PATHS, in_flight=in_flight)
    router = APIRouter()

    @router.get("/v1/models")
    async def models() -> Response:
        cards = [
            ModelCard(id=name, root=ctx.model_path, max_model_len=ctx.max_model_len)
            for name in ctx.model_names
        ]
        return _json(ModelList(data=cards))

    @router.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request) -> Response:
        return await create_completion(ctx, request, raw)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(ctx, request, raw)

    @router.post("/invocations")
    async def invocations(raw: Request) -> Response:
        """A chat completion when the body has ``messages``, a completion when it has
        ``prompt``; answered as that route answers it."""
        body = await json_body(raw)
        fields = keys(body)
        if {"messages", "prompt"} <= fields:
            raise bad_request(
                "An /invocations body has messages (a chat completion) or prompt (a "
                "completion), not both.",
                param="prompt",
            )
        if "messages" in fields:
            chat = validated(ChatCompletionRequest, body)
            return await create_chat_completion(ctx, chat, raw)
        if "prompt" in fields:
            return await create_completion(ctx, validated(CompletionRequest, body), raw)
        raise bad_request(
            "An /invocations body is a chat completion (with messages) or a completion (with "
            "prompt); this one has neither.",
            param="messages",
        )

    @router.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        """``prompt`` (a text) or ``messages`` (rendered by the chat template) to token ids."""
        return _json(tokenization.tokenize(ctx, await json_body(raw)))

    @router.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> Response:
        return _json(tokenization.detokenize(ctx, request))

    @router.get("/load")
    async def load() -> Response:
        return _json(ServerLoad(server_load=in_flight.count))

    app.include_router(router)


@hookimpl
def pagellm_endpoint() -> EndpointPlugin:
    return EndpointPlugin(
        attach=attach,
        required_tasks=frozenset({"generate"}),
        description="OpenAI-compatible API: models, completions, chat completions, tokenize",
    )
