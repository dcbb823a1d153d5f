"""What the routes share: the served model's limits, prompt rendering and the checks a request
must pass before it reaches the engine (each refusal is an HTTP 400 naming the parameter)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from pagellm.entrypoints.http_errors import bad_request, served_model_name
from pagellm.entrypoints.server_context import EngineClient, ServerContext
from pagellm.io_processors import IOProcessorInputError
from pagellm.multimodal import MultiModalItem
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    SamplingParamsError,
    logprobs_count,
)
from pagellm_openai.chat_template import ChatTemplates
from pagellm_openai.field_policy import check_best_of
from pagellm_openai.protocol import ChatTemplateRequest, SamplingRequest


@dataclass
class Prompt:
    """One prompt as the engine gets it: its text (when known), its token ids and its
    multimodal items (their placeholders expanded in the token ids)."""

    text: str | None
    token_ids: list[int]
    mm_items: list[MultiModalItem] = field(default_factory=list)

    def engine_input(self, cache_salt: str | None) -> dict[str, Any]:
        """The prompt as the engine takes it: its token ids (its text and items too, when it
        has them)."""
        prompt: dict[str, Any] = {"prompt_token_ids": self.token_ids}
        if self.text is not None:
            prompt["prompt"] = self.text
        if self.mm_items:
            prompt["multi_modal_items"] = self.mm_items
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        return prompt


@dataclass
class ServingContext:
    engine: EngineClient
    model_names: list[str]
    model_path: str
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    max_logprobs: int
    """Most logprobs a token one request may ask for (``--max-logprobs``; -1: the vocabulary)."""
    max_sequences_per_request: int
    """Prompts × n one HTTP request may ask for (``--max-sequences-per-request``)."""
    chat_templates: ChatTemplates
    enable_prompt_tokens_details: bool = False
    """``usage.prompt_tokens_details`` in responses (``--enable-prompt-tokens-details``)."""
    return_tokens_as_token_ids: bool = False
    """The default of the requests' ``return_tokens_as_token_ids``."""
    default_sampling: dict[str, Any] = field(default_factory=dict)
    """The model's sampling defaults for requests that leave them unset (``--generation-config``:
    temperature, top_p, top_k, min_p, repetition_penalty, max_tokens)."""

    @classmethod
    def from_server(cls, server: ServerContext) -> ServingContext:
        engine = server.engine_client
        config = engine.config
        return cls(
            engine=engine,
            model_names=list(server.served_model_names),
            model_path=server.model_path,
            max_model_len=config.model.max_model_len,
            max_num_seqs=config.scheduler.max_num_seqs,
            vocab_size=config.model.vocab_size,
            max_logprobs=config.model.max_logprobs,
            max_sequences_per_request=server.args.max_sequences_per_request,
            chat_templates=ChatTemplates(
                server.args.chat_template, server.args.trust_request_chat_template
            ),
            enable_prompt_tokens_details=server.args.enable_prompt_tokens_details,
            return_tokens_as_token_ids=server.args.return_tokens_as_token_ids,
            default_sampling=dict(config.model.default_sampling),
        )

    def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str, request: SamplingRequest
    ) -> AsyncGenerator[RequestOutput, None]:
        """The engine's outputs for ``prompt``, with the request's priority and cache salt.

        The engine request's id is ``request_id`` and a random suffix: clients choose request
        ids (``X-Request-Id``, ``request_id``), and two requests that share one both run."""
        engine_input = prompt.engine_input(request.cache_salt)
        engine_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        return self.engine.generate(engine_input, params, engine_id, request.priority)

    @staticmethod
    def response_id(prefix: str, request: SamplingRequest, raw: Request) -> str:
        """``prefix`` and the request's id: the client's ``X-Request-Id`` header, else its
        ``request_id`` field, else the one the server made (vLLM's precedence)."""
        if raw.headers.get("x-request-id") or request.request_id is None:
            return f"{prefix}-{raw.state.request_id}"
        return f"{prefix}-{request.request_id}"

    def tokens_as_ids(self, request: SamplingRequest) -> bool:
        """Whether logprobs name their tokens ``token_id:N``: the request says, else the server."""
        if request.return_tokens_as_token_ids is None:
            return self.return_tokens_as_token_ids
        return request.return_tokens_as_token_ids

    def truncate(self, prompt: Prompt, request: SamplingRequest, output_tokens: int) -> Prompt:
        """``prompt`` cut to ``request.truncate_prompt_tokens`` tokens (its last ones, or its
        first with ``truncation_side="right"``), leaving room for ``output_tokens``."""
        keep = request.truncate_prompt_tokens
        if keep is not None and prompt.mm_items:
            raise bad_request(
                "truncate_prompt_tokens cannot cut a prompt with images (it would cut through "
                "their tokens); shorten the messages instead.",
                param="truncate_prompt_tokens",
            )
        if keep is None:
            if request.truncation_side is not None:
                raise bad_request(
                    "truncation_side only applies with truncate_prompt_tokens.",
                    param="truncation_side",
                )
            return prompt
        limit = self.max_model_len - output_tokens
        if limit < 1:
            return prompt  # the output alone fills the context: output_budget refuses it
        if keep == -1:
            keep = limit
        if not 1 <= keep <= limit:
            raise bad_request(
                f"truncate_prompt_tokens={request.truncate_prompt_tokens} must be -1 (as many "
                f"as fit) or from 1 to max_model_len ({self.max_model_len}) - the tokens to "
                f"generate ({output_tokens}) = {limit}.",
                param="truncate_prompt_tokens",
            )
        ids = prompt.token_ids
        if len(ids) <= keep:
            return prompt
        kept = ids[:keep] if request.truncation_side == "right" else ids[-keep:]
        return Prompt(None, kept)  # the text no longer matches: echo decodes the kept tokens

    def check_num_sequences(self, num_prompts: int, n: int) -> None:
        """One request may not ask for more sequences than ``--max-sequences-per-request``."""
        limit = self.max_sequences_per_request
        if num_prompts * n > limit:
            raise bad_request(
                f"The request asks for {num_prompts} prompt(s) × n={n} = {num_prompts * n} "
                f"sequences; this server allows at most {limit} per request "
                "(--max-sequences-per-request).",
                param="prompt" if num_prompts > 1 else "n",
                code="too_many_sequences",
            )

    @property
    def tokenizer(self) -> Any:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise bad_request(
                "This server runs without a tokenizer (--skip-tokenizer-init): send prompts as "
                "token ids to /v1/completions."
            )
        return tokenizer

    def model_name(self, requested: str | None) -> str:
        """The name to report; a name the server does not serve is refused (404)."""
        return served_model_name(requested, self.model_names)

    def text_prompt(self, text: str, add_special_tokens: bool = True) -> Prompt:
        if not text:
            raise bad_request("prompt is empty.", param="prompt")
        return Prompt(
            text, list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        )

    def token_prompt(self, token_ids: list[int]) -> Prompt:
        if not token_ids:
            raise bad_request("prompt is empty.", param="prompt")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(
                f"prompt has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}.",
                param="prompt",
            )
        return Prompt(None, token_ids)

    def chat_prompt(self, request: ChatTemplateRequest) -> tuple[Prompt, str]:
        """The request's messages rendered by its chat template, and the role of the answer
        (text only: a media part is refused)."""
        chat = self.chat_templates.render(self.tokenizer, request)
        return Prompt(chat.text, chat.token_ids), chat.role

    async def chat_prompt_with_media(self, request: ChatTemplateRequest) -> tuple[Prompt, str]:
        """`chat_prompt`, with the messages' images: each ``image_url`` part rendered as the
        IO processor's placeholder, then the processor's ``parse_request`` (decoding, limits)
        and ``pre_process`` (placeholders expanded, items made). Its refusals are 400s."""
        urls = [url for message in request.messages for url in message.image_urls()]
        io = self.engine.io_processor
        if not urls or io is None:
            return self.chat_prompt(request)
        chat = self.chat_templates.render(self.tokenizer, request, io.chat_placeholders)
        raw = {
            "prompt": chat.text,
            "prompt_token_ids": chat.token_ids,
            "multi_modal_data": {"image": urls},
        }
        try:
            prompts = await io.pre_process_async(await io.parse_request_async(raw))
        except IOProcessorInputError as exc:
            raise bad_request(str(exc), param="messages") from exc
        [engine_prompt] = prompts
        if not isinstance(engine_prompt, dict):
            raise TypeError(f"The IO processor made a {type(engine_prompt).__name__} prompt.")
        return (
            Prompt(
                chat.text, engine_prompt["prompt_token_ids"], engine_prompt["multi_modal_items"]
            ),
            chat.role,
        )

    def output_budget(
        self,
        prompt: Prompt,
        requested: int | None,
        default: int | None,
        param: str,
        prompt_param: str,
    ) -> int:
        """How many tokens to generate after ``prompt``: ``requested``, else ``default`` (None:
        as many as the context leaves), capped by the model's generation config
        (``max_new_tokens``) as vLLM caps it, within max_model_len."""
        room = self.max_model_len - len(prompt.token_ids)
        if room < 1:
            raise bad_request(
                f"The prompt is {len(prompt.token_ids)} tokens long and max_model_len is "
                f"{self.max_model_len}, which leaves no room to generate; shorten the prompt.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if requested is None:
            limits = (room, default, self.default_sampling.get("max_tokens"))
            return min(limit for limit in limits if limit is not None)
        if requested > room:
            raise bad_request(
                f"{param}={requested} is too large: the prompt is {len(prompt.token_ids)} tokens "
                f"long and max_model_len is {self.max_model_len}, so at most {room} tokens can be "
                "generated.",
                param=param,
                code="context_length_exceeded",
            )
        return requested

    def sampling_params(
        self,
        request: SamplingRequest,
        max_tokens: int,
        logprobs: int | None,
        echo_logprobs: int | None = None,
        logprobs_param: str = "logprobs",
    ) -> SamplingParams:
        """The engine's parameters for ``request``; ``echo_logprobs``: the prompt logprobs an
        echo needs when the request asks for none itself; ``logprobs_param``: the request's
        field that ``logprobs`` comes from."""
        self.check_logprobs(logprobs, logprobs_param)
        self.check_logprobs(request.prompt_logprobs, "prompt_logprobs")
        if request.n > self.max_num_seqs:
            raise bad_request(
                f"n={request.n} is larger than this server's limit of {self.max_num_seqs} "
                "(--max-num-seqs).",
                param="n",
            )
        check_best_of(request.best_of, request.n)
        options = request.stream_options
        if options is not None and not request.stream:
            raise bad_request(
                "stream_options is only allowed with stream=true.", param="stream_options"
            )
        if options is not None and options.continuous_usage_stats and not options.include_usage:
            raise bad_request(
                "stream_options.continuous_usage_stats needs stream_options.include_usage=true.",
                param="stream_options",
            )
        if request.return_tokens_as_token_ids and logprobs is None:
            raise bad_request(
                "return_tokens_as_token_ids only changes logprobs: ask for logprobs too.",
                param="return_tokens_as_token_ids",
            )
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is None:
            prompt_logprobs = echo_logprobs
        try:
            return SamplingParams(
                n=request.n,
                temperature=self._or_default(request.temperature, "temperature", 1.0),
                top_p=self._or_default(request.top_p, "top_p", 1.0),
                top_k=self._or_default(request.top_k, "top_k", 0),
                min_p=self._or_default(request.min_p, "min_p", 0.0),
                seed=request.seed,
                presence_penalty=request.presence_penalty or 0.0,
                frequency_penalty=request.frequency_penalty or 0.0,
                repetition_penalty=self._or_default(
                    request.repetition_penalty, "repetition_penalty", 1.0
                ),
                logit_bias=self._logit_bias(request.logit_bias),
                allowed_token_ids=request.allowed_token_ids,
                bad_words=request.bad_words or None,
                stop=None if request.stop == [] else request.stop,
                stop_token_ids=request.stop_token_ids,
                include_stop_str_in_output=request.include_stop_str_in_output,
                ignore_eos=request.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=request.skip_special_tokens,
                spaces_between_special_tokens=request.spaces_between_special_tokens,
                output_kind=(
                    RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
                ),
            )
        except SamplingParamsError as exc:
            raise bad_request(str(exc), param=exc.param) from exc
        except ValueError as exc:
            raise bad_request(str(exc)) from exc

    def check_logprobs(self, count: int | None, param: str) -> None:
        """A 400 naming ``param`` when it asks for more logprobs than ``--max-logprobs`` allows
        (the engine checks again when the request is added, naming its own field)."""
        if count is not None:
            try:
                logprobs_count(param, count, self.max_logprobs, self.vocab_size)
            except SamplingParamsError as exc:
                raise bad_request(str(exc), param=param) from exc

    def _or_default(self, value: Any, name: str, api_default: Any) -> Any:
        """A request's sampling value; unset, the model's generation config default, else the
        API's."""
        if value is not None:
            return value
        return self.default_sampling.get(name, api_default)

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        if not bias:
            return None
        result: dict[int, float] = {}
        for key, value in bias.items():
            # ASCII digits only: str.isdigit() takes "²", which int() refuses.
            digits = key.removeprefix("-")
            token = int(key) if digits.isascii() and digits.isdecimal() else None
            if token is None or not 0 <= token < self.vocab_size:
                raise bad_request(
                    f"logit_bias key {key!r} is not a token id of the vocabulary "
                    f"[0, {self.vocab_size}).",
                    param="logit_bias",
                )
            result[token] = value
        return result
