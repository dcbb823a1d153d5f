"""The ``embeddings`` endpoint plugin: ``POST /v1/embeddings`` (OpenAI's shape) and
``GET /v1/models``, for a model served by the pooling runner (``required_tasks={"embed"}``: the
server attaches it to no other model, and attaches the generation routes to none of these).

Each request runs the `EmbeddingsProcessor`'s stages; its inputs run as one engine request each
(`AsyncLLM.encode`), all at once, so the engine batches them. An input the engine refuses (too
long, outside the vocabulary) answers 400 naming it, and the request's other inputs are aborted.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from pagellm.engine.processor import PromptType
from pagellm.entrypoints.http_errors import bad_request, served_model_name
from pagellm.entrypoints.server_context import EngineClient, ServerContext
from pagellm.outputs import EmbeddingRequestOutput
from pagellm.plugins import EndpointPlugin, hookimpl
from pagellm.pooling_params import PoolingParams
from pagellm_io_embeddings.processor import EmbeddingsProcessor
from pagellm_io_embeddings.protocol import EmbeddingRequest

pagellm_plugin_api = "1.3"


def _processor(server: ServerContext) -> EmbeddingsProcessor:
    """The engine's IO processor when it is this one (``--io-processor embeddings``), else one
    built here, in the same front-end process."""
    engine = server.engine_client
    if isinstance(engine.io_processor, EmbeddingsProcessor):
        return engine.io_processor
    return EmbeddingsProcessor(engine.config, engine.tokenizer)


async def _embed_one(
    engine: EngineClient, index: int, prompt: PromptType, params: PoolingParams, request_id: str
) -> EmbeddingRequestOutput:
    try:
        async with aclosing(engine.encode(prompt, params, request_id)) as outputs:
            async for output in outputs:
                if output.finished:
                    return output
    except ValueError as exc:
        param = getattr(exc, "param", None)
        own = param in ("truncate_prompt_tokens", "dimensions")
        raise bad_request(f"input[{index}]: {exc}", param=param if own else "input") from None
    raise RuntimeError(f"The engine ended request {request_id} without an output.")


async def embed_all(
    engine: EngineClient, prompts: list[PromptType], params: PoolingParams, request_id: str
) -> list[EmbeddingRequestOutput]:
    """Every prompt's output, in order. The first to fail cancels (so aborts) the others, and
    its error is raised."""
    suffix = uuid.uuid4().hex[:8]  # clients choose request ids: two requests may share one
    tasks = [
        asyncio.ensure_future(_embed_one(engine, i, prompt, params, f"{request_id}-{i}-{suffix}"))
        for i, prompt in enumerate(prompts)
    ]
    try:
        return list(await asyncio.gather(*tasks))
    finally:  # after a failure (or the client leaving): the others stop, aborting their requests
        pending = [task for task in tasks if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


def attach(app: FastAPI, server: ServerContext) -> None:
    processor = _processor(server)
    engine = server.engine_client
    names = list(server.served_model_names)
    max_inputs = server.args.max_sequences_per_request
    router = APIRouter()

    def model_name(requested: str | None) -> str:
        return served_model_name(requested, names)

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        created = int(time.time())
        cards = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "pagellm",
                "root": server.model_path,
                "max_model_len": engine.config.model.max_model_len,
            }
            for name in names
        ]
        return {"object": "list", "data": cards}

    @router.post("/v1/embeddings")
    async def create_embeddings(request: EmbeddingRequest, raw: Request) -> JSONResponse:
        name = model_name(request.model)
        data = await processor.parse_request_async(request)
        data.model = name
        prompts = await processor.pre_process_async(data)
        if len(prompts) > max_inputs:
            raise bad_request(
                f"input has {len(prompts)} items; this server takes at most {max_inputs} per "
                "request (--max-sequences-per-request).",
                param="input",
            )
        request_id = f"embd-{raw.state.request_id}"
        outputs = await embed_all(engine, prompts, data.params, request_id)
        result = await processor.post_process_async(outputs, data)
        body = {
            "id": request_id,
            "created": int(time.time()),
            **processor.output_to_response(result),
        }
        return JSONResponse(body)

    app.include_router(router)


@hookimpl
def pagellm_endpoint() -> EndpointPlugin:
    return EndpointPlugin(
        attach=attach,
        required_tasks=frozenset({"embed"}),
        description="OpenAI-compatible embeddings: /v1/embeddings, /v1/models",
    )
