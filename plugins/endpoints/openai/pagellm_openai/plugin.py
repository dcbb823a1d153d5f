"""The ``openai`` endpoint plugin: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
``/tokenize`` and ``/detokenize``, for models that generate text."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response

from pagellm.entrypoints.http_errors import bad_request
from pagellm.entrypoints.server_context import ServerContext
from pagellm.plugins import EndpointPlugin, hookimpl
from pagellm_openai.chat import create_chat_completion
from pagellm_openai.completions import create_completion
from pagellm_openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagellm_openai.serving import ServingContext

pagellm_plugin_api = "1.1"


def _json(body: Any) -> Response:
    return Response(body.model_dump_json(), media_type="application/json")


def attach(app: FastAPI, server: ServerContext) -> None:
    ctx = ServingContext.from_server(server)
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

    @router.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> Response:
        ctx.model_name(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise bad_request("Send either prompt or messages.", param="prompt")
        if request.messages is not None:
            prompt = ctx.chat_prompt(request.messages, request.add_generation_prompt)
        else:
            prompt = ctx.text_prompt(request.prompt or "", request.add_special_tokens)
        tokens = prompt.token_ids
        return _json(
            TokenizeResponse(count=len(tokens), max_model_len=ctx.max_model_len, tokens=tokens)
        )

    @router.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> Response:
        ctx.model_name(request.model)
        tokenizer = ctx.tokenizer
        bad = [t for t in request.tokens if not 0 <= t < len(tokenizer)]
        if bad:
            raise bad_request(
                f"tokens has ids outside the tokenizer's vocabulary [0, {len(tokenizer)}): "
                f"{bad[:5]}.",
                param="tokens",
            )
        return _json(DetokenizeResponse(prompt=tokenizer.decode(request.tokens)))

    app.include_router(router)


@hookimpl
def pagellm_endpoint() -> EndpointPlugin:
    return EndpointPlugin(
        attach=attach,
        required_tasks=frozenset({"generate"}),
        description="OpenAI-compatible API: models, completions, chat completions, tokenize",
    )
