"""The request fields pagellm takes without acting on them, and those it refuses.

Each field of a request is implemented (declared in `protocol`), accepted as a no-op
(`AcceptedNoOps`: OpenAI fields that change nothing in the output), or refused (`RefusedFields`
and the per-route classes below). Any other field is unknown, and a 400 too: the request models
forbid extra fields. A refused field is refused only when its value asks for something: absent,
null, or the value that means what the server does anyway (``tool_choice: "none"``) passes. The
400 names the field (``param``) with ``code: "unsupported_parameter"``. docs/serving.md ("Request
fields: accepted, refused") lists the same tables.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, Field
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from pagellm.entrypoints.http_errors import UNSUPPORTED_PARAMETER, bad_request
from pagellm.sampling_params import INT64_MAX


def _asks_nothing(value: Any, harmless: tuple[object, ...]) -> bool:
    # A bool is no stand-in for a number here (True == 1 in Python).
    return value is None or any(
        value == ok and isinstance(value, bool) == isinstance(ok, bool) for ok in harmless
    )


def _refused(feature: str, *harmless: object) -> AfterValidator:
    """A field pagellm does not implement: null or one of ``harmless`` passes (as None); any
    other value is refused, the message saying what the field asks for (``feature``)."""

    def check(value: Any) -> None:
        if not _asks_nothing(value, harmless):
            raise PydanticCustomError(UNSUPPORTED_PARAMETER, feature)
        return None

    return AfterValidator(check)


# Refused fields take any JSON and are left out of the OpenAPI schema: it shows what is served.
Refused = SkipJsonSchema[Any]

_STRUCTURED = "structured output is not implemented"
_BEAM = "beam search is not implemented"
_MULTIMODAL = "the server takes text only"


class AcceptedNoOps(BaseModel):
    """OpenAI fields accepted and ignored: none changes the text, tokens or logprobs generated."""

    user: str | None = None
    """An end-user id (OpenAI's abuse monitoring)."""
    safety_identifier: str | None = None
    """The successor of ``user`` for abuse monitoring."""
    metadata: dict[str, str] | None = None
    """Tags OpenAI stores with the completion (``store``); pagellm stores nothing."""
    store: bool | None = None
    """Whether OpenAI keeps the completion for its dashboard and evals; pagellm keeps none."""
    service_tier: str | None = None
    """OpenAI's pricing and latency tier; pagellm has one."""
    prompt_cache_key: str | None = None
    """OpenAI's hint to route requests to the same cache; pagellm's prefix cache (unless
    ``cache_salt`` says otherwise) serves every request of the server."""
    prompt_cache_retention: str | None = None
    """How long OpenAI keeps a cached prefix; pagellm keeps blocks while memory allows."""
    prompt_cache_options: dict[str, Any] | None = None
    """OpenAI's cache breakpoints and their lifetime; likewise."""
    parallel_tool_calls: bool | None = None
    """Whether tool calls may run in parallel: meaningless without ``tools``, which are refused."""
    session_id: str | None = None
    """vLLM's stable id of related requests, for routing and tracing."""


class RefusedFields(BaseModel):
    """Fields of OpenAI's API and vLLM's extensions pagellm does not implement (both routes)."""

    # OpenAI: tools, output formats and features of its hosted models.
    tools: Annotated[Refused, _refused("tool calling is not implemented")] = None
    tool_choice: Annotated[
        Refused, _refused('tool calling is not implemented; "none" is accepted', "none")
    ] = None
    functions: Annotated[Refused, _refused("function calling is not implemented")] = None
    function_call: Annotated[
        Refused, _refused('function calling is not implemented; "none" is accepted', "none")
    ] = None
    response_format: Annotated[
        Refused,
        _refused(f'{_STRUCTURED}; {{"type": "text"}}, the default, is accepted', {"type": "text"}),
    ] = None
    modalities: Annotated[
        Refused, _refused('the server generates text only; ["text"] is accepted', ["text"])
    ] = None
    audio: Annotated[Refused, _refused("audio output is not implemented")] = None
    prediction: Annotated[Refused, _refused("predicted outputs are not implemented")] = None
    reasoning_effort: Annotated[Refused, _refused("reasoning effort is not implemented")] = None
    verbosity: Annotated[Refused, _refused("verbosity control is not implemented")] = None
    web_search_options: Annotated[Refused, _refused("web search is not implemented")] = None
    moderation: Annotated[Refused, _refused("moderation is not implemented")] = None
    # vLLM: structured outputs (the newer structured_outputs and the older guided_* fields).
    structured_outputs: Annotated[Refused, _refused(_STRUCTURED)] = None
    guided_json: Annotated[Refused, _refused(_STRUCTURED)] = None
    guided_regex: Annotated[Refused, _refused(_STRUCTURED)] = None
    guided_choice: Annotated[Refused, _refused(_STRUCTURED)] = None
    guided_grammar: Annotated[Refused, _refused(_STRUCTURED)] = None
    guided_decoding_backend: Annotated[Refused, _refused(_STRUCTURED)] = None
    guided_whitespace_pattern: Annotated[Refused, _refused(_STRUCTURED)] = None
    structural_tag: Annotated[Refused, _refused(_STRUCTURED)] = None
    # vLLM: sampling it does and pagellm does not.
    use_beam_search: Annotated[Refused, _refused(_BEAM, False)] = None
    length_penalty: Annotated[Refused, _refused(f"{_BEAM}; 1.0 is accepted", 1.0)] = None
    early_stopping: Annotated[Refused, _refused(_BEAM, False)] = None
    watermarking: Annotated[Refused, _refused("watermarking is not implemented", False)] = None
    logits_processors: Annotated[
        Refused, _refused("custom logits processors are not implemented")
    ] = None
    logprob_token_ids: Annotated[
        Refused, _refused("logprobs of chosen token ids are not implemented")
    ] = None
    repetition_detection: Annotated[
        Refused, _refused("repetition detection is not implemented")
    ] = None
    thinking_token_budget: Annotated[
        Refused, _refused("thinking budgets are not implemented; -1 is accepted", -1)
    ] = None
    include_reasoning: Annotated[
        Refused, _refused("reasoning parsing is not implemented; true is accepted", True)
    ] = None
    stream_interval: Annotated[
        Refused, _refused("a stream sends every engine step's tokens; 1 is accepted", 1)
    ] = None
    # vLLM: deployments and inputs pagellm does not have.
    vllm_xargs: Annotated[Refused, _refused("custom extensions are not implemented")] = None
    kv_transfer_params: Annotated[Refused, _refused("disaggregated serving is not implemented")] = (
        None
    )
    ec_transfer_params: Annotated[Refused, _refused("disaggregated serving is not implemented")] = (
        None
    )
    mm_processor_kwargs: Annotated[Refused, _refused(_MULTIMODAL)] = None
    media_io_kwargs: Annotated[Refused, _refused(_MULTIMODAL)] = None
    return_prompt_text: Annotated[
        Refused, _refused("the rendered prompt is not returned", False)
    ] = None
    return_token_offsets: Annotated[Refused, _refused("token offsets are not returned", False)] = (
        None
    )
    return_mm_kwargs: Annotated[Refused, _refused(_MULTIMODAL, True)] = None
    routed_experts_prompt_start: Annotated[
        Refused, _refused("expert routing data is not returned; 0 is accepted", 0)
    ] = None
    # Accepted only when it equals n (see `check_best_of`).
    best_of: int | None = Field(None, ge=1, le=INT64_MAX)


class RefusedCompletionFields(BaseModel):
    """Refused on ``/v1/completions`` only."""

    suffix: Annotated[
        Refused, _refused('text after an insertion point is not implemented; "" is accepted', "")
    ] = None
    prompt_embeds: Annotated[Refused, _refused("prompts as embeddings are not implemented")] = None


class RefusedStreamOptions(BaseModel):
    """Refused in ``stream_options``."""

    include_obfuscation: Annotated[
        Refused, _refused("stream events are not padded; false is accepted", False)
    ] = None


def check_best_of(best_of: int | None, n: int) -> None:
    """``best_of`` of n (or none) is what the server does: every sequence it generates is
    returned. Less than n is a contradiction, more a search pagellm does not do."""
    if best_of is None or best_of == n:
        return
    if best_of < n:
        raise bad_request(f"best_of ({best_of}) must not be less than n ({n}).", param="best_of")
    raise bad_request(
        f"best_of={best_of} is not supported by this server (generating more sequences than n "
        f"and returning the best is not implemented; best_of equal to n, {n}, is accepted).",
        param="best_of",
        code=UNSUPPORTED_PARAMETER,
    )
