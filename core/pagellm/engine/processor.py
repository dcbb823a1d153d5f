"""Front-end input processing: tokenize and validate a prompt once, and build its engine requests
(one per completion)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from pagellm.config import EngineConfig
from pagellm.multimodal.inputs import MultiModalItem, check_items
from pagellm.pooling_params import PoolingParams
from pagellm.request import POOLING_SAMPLING_PARAMS, EngineCoreRequest
from pagellm.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    RequestOutputKind,
    SamplingParams,
    SamplingParamsError,
    logprobs_count,
)
from pagellm.scheduler.policy import scheduling_policies

if TYPE_CHECKING:
    from pagellm.io_processors import IOProcessor

PromptType = str | list[int] | dict[str, Any]
"""Text, token ids, or a dict with ``prompt`` and/or ``prompt_token_ids`` (used when given) and
optionally ``cache_salt``; for a multimodal model, ``multi_modal_items`` (`MultiModalItem`s, their
placeholders expanded in the token ids, as an IO processor's ``pre_process`` makes them) or
``multi_modal_data`` (vLLM's ``{"image": PIL image or a list of them}``, with the placeholders
unexpanded: the front end's IO processor turns it into the former)."""


@dataclass
class ProcessedPrompt:
    """A prompt as the engine core gets it, with its parameters."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    """Prompts of different salts share no prefix-cache blocks (vLLM's ``cache_salt``)."""
    mm_items: list[MultiModalItem] = field(default_factory=list)
    pooling_params: PoolingParams | None = None
    """Set for a pooling request (``normalize`` resolved); ``params`` are then
    `POOLING_SAMPLING_PARAMS`."""


def fan_out(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """The engine requests (id, parameters) a user request runs as: itself, or one per completion
    for n > 1, ``"{i}_{request_id}"``; with a seed, completion i uses seed + i, so each is
    reproducible on its own and independent of the batch."""
    if params.n == 1:
        return [(request_id, params)]
    return [
        (
            f"{i}_{request_id}",
            msgspec.structs.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i
            ),
        )
        for i in range(params.n)
    ]


def _config_eos_id(config: EngineConfig) -> int | None:
    """The model config's EOS id (the first, when it lists several), for tokenizer-less engines."""
    eos = getattr(config.model.text_config, "eos_token_id", None)
    if isinstance(eos, list):
        return int(eos[0]) if eos else None
    return None if eos is None else int(eos)


def _generation_config_eos_ids(config: EngineConfig) -> set[int]:
    """EOS ids a checkpoint's generation_config.json adds (Llama 3 has several)."""
    if config.model.gguf_file:
        return set()
    from transformers import GenerationConfig

    directory = config.model.model
    if not os.path.isfile(os.path.join(directory, "generation_config.json")):
        return set()
    eos = GenerationConfig.from_pretrained(directory).eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {int(eos)}


class InputProcessor:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any,
        io_processor: IOProcessor[Any, Any] | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.io_processor = io_processor
        """Turns a prompt's ``multi_modal_data`` into items (the model's, from the front end)."""
        self.vocab_size = config.model.vocab_size
        self.eos_token_id: int | None = (
            tokenizer.eos_token_id if tokenizer is not None else _config_eos_id(config)
        )
        self.extra_eos_ids = _generation_config_eos_ids(config) - {self.eos_token_id}
        policy = scheduling_policies.get(config.scheduler.policy)
        self.orders_by_priority = policy.orders_by_priority

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids) for a string, a token-id list or a prompt dict."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise ValueError("prompt dict needs a 'prompt' or 'prompt_token_ids' key.")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty.")
            if self.tokenizer is None:
                raise ValueError(
                    "This engine has no tokenizer (skip_tokenizer_init): pass prompt_token_ids."
                )
            # A tokenizer can know more tokens than the model (e.g. a shared tokenizer on a
            # smaller test model): such ids are refused here, before they reach the engine.
            return prompt, self._check_ids(list(self.tokenizer.encode(prompt)))
        if isinstance(prompt, (list, tuple)):
            return None, self._check_ids(list(prompt))
        raise ValueError(
            f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}."
        )

    def _check_ids(self, ids: list[Any]) -> list[int]:
        if not ids:
            raise ValueError("prompt_token_ids is empty.")
        self._check_vocab("prompt_token_ids", ids)
        return ids

    def _check_vocab(self, name: str, ids: list[Any]) -> None:
        vocab_size = self.vocab_size
        # All plain ints in range, checked at C speed (a 2,048-token prompt in ~30 us, not
        # ~800): the usual case. Anything else is looked at id by id below, for the message.
        if ids and set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size:
            return
        bad = [
            t
            for t in ids
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size
        ]
        if bad:
            raise SamplingParamsError(
                name,
                f"{name} has {len(bad)} token id(s) outside the vocabulary [0, {vocab_size}): "
                f"{bad[:5]}.",
            )

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token sequences, with and without a leading space (as it may follow a word)."""
        sequences: list[list[int]] = []
        for word in words:
            for prefix in ("", " "):
                ids = list(self.tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def check_generates(self) -> None:
        """``ValueError`` unless the model generates (a pooling model embeds, and only that)."""
        model = self.config.model
        if model.runner == "pooling":
            raise ValueError(
                f"{model.architecture} is served by the pooling runner (tasks: "
                f"{', '.join(sorted(model.tasks))}): it embeds prompts and generates no text. Use "
                "LLM.embed (or the /v1/embeddings endpoint), or serve a generative model."
            )

    def _multimodal(self, prompt: dict[str, Any]) -> dict[str, Any]:
        """A prompt with ``multi_modal_data`` as the IO processor makes it (token ids, items)."""
        io = self.io_processor
        if io is None:
            raise ValueError(
                "multi_modal_data needs the IO processor of the model's media, and this engine "
                "runs with none: start it with --io-processor image (pagellm-io-image)."
            )
        prompts = io.pre_process(io.parse_request(prompt))
        if len(prompts) != 1 or not isinstance(prompts[0], dict):
            raise ValueError(
                f"The IO processor {self.config.model.io_processor!r} made {len(prompts)} "
                "prompts of one prompt with multi_modal_data; it must make one prompt dict."
            )
        return {**prompts[0], "cache_salt": prompt.get("cache_salt")}

    def process(self, prompt: PromptType, params: SamplingParams) -> ProcessedPrompt:
        """Tokenize and validate (``ValueError`` naming what is wrong)."""
        self.check_generates()
        if isinstance(prompt, dict) and "multi_modal_data" in prompt:
            prompt = self._multimodal(prompt)
        text, ids = self.tokenize(prompt)
        mm_items = list(prompt.get("multi_modal_items") or ()) if isinstance(prompt, dict) else []
        check_items(ids, mm_items, self.config.model.multimodal_specs)
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}.")
        max_len = self.config.model.max_model_len
        if len(ids) >= max_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens long, which leaves no room to generate within "
                f"max_model_len={max_len}."
            )
        if params.n > self.config.scheduler.max_num_seqs:
            raise ValueError(
                f"n={params.n} is larger than max_num_seqs={self.config.scheduler.max_num_seqs}."
            )
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            if getattr(params, name):
                self._check_vocab(name, list(getattr(params, name)))
        params = params.clone()
        self._resolve_logprobs(params)
        if params.top_k >= self.vocab_size:
            params.top_k = 0  # keeping every token of the vocabulary is no top-k at all
        if not params.ignore_eos and self.extra_eos_ids:
            params.stop_token_ids = sorted(set(params.stop_token_ids or ()) | self.extra_eos_ids)
        if self.tokenizer is None and (params.bad_words or params.stop):
            raise ValueError(
                "bad_words and stop strings need a tokenizer, and this engine has none "
                "(skip_tokenizer_init); use stop_token_ids."
            )
        if params.bad_words:
            params.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        return ProcessedPrompt(text, ids, params, cache_salt, mm_items)

    def _resolve_logprobs(self, params: SamplingParams) -> None:
        """logprobs / prompt_logprobs within ``--max-logprobs`` (`logprobs_count`); -1, the
        whole vocabulary, becomes the vocabulary's size."""
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None:
                limit = self.config.model.max_logprobs
                setattr(params, name, logprobs_count(name, asked, limit, self.vocab_size))

    def process_pooling(self, prompt: PromptType, params: PoolingParams) -> ProcessedPrompt:
        """Tokenize (cut to ``truncate_prompt_tokens`` when asked) and validate a pooling
        request (``ValueError`` naming what is wrong)."""
        model = self.config.model
        if model.pooler is None:
            raise ValueError(
                f"{model.architecture} is served by the generate runner: it cannot embed. Serve "
                "an embedding model (runner pooling)."
            )
        if params.dimensions is not None:
            raise SamplingParamsError(
                "dimensions",
                f"dimensions={params.dimensions}: {model.architecture} has no Matryoshka "
                "dimensions; leave dimensions unset to get its full vectors.",
            )
        max_len = model.max_model_len
        keep = params.truncate_prompt_tokens
        if keep is not None:
            keep = max_len if keep == -1 else keep
            if keep > max_len:
                raise SamplingParamsError(
                    "truncate_prompt_tokens",
                    f"truncate_prompt_tokens={keep} is more than max_model_len={max_len}.",
                )
        text, ids = self._tokenize_truncated(prompt, keep)
        if len(ids) > max_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens long, more than max_model_len={max_len}; shorten "
                "it, or ask for truncate_prompt_tokens."
            )
        normalize = model.pooler.normalize if params.normalize is None else params.normalize
        pooling = msgspec.structs.replace(params, normalize=normalize)
        bookkeeping = msgspec.structs.replace(
            POOLING_SAMPLING_PARAMS, output_kind=RequestOutputKind.FINAL_ONLY
        )
        return ProcessedPrompt(text, ids, bookkeeping, None, pooling_params=pooling)

    def _tokenize_truncated(
        self, prompt: PromptType, keep: int | None
    ) -> tuple[str | None, list[int]]:
        """`tokenize`, then at most ``keep`` tokens: a text through its tokenizer's truncation
        (on its own side, special tokens kept), token ids their last ``keep``."""
        has_ids = isinstance(prompt, dict) and "prompt_token_ids" in prompt
        text = prompt.get("prompt") if isinstance(prompt, dict) and not has_ids else prompt
        if keep is not None and isinstance(text, str) and text and self.tokenizer is not None:
            ids = self.tokenizer(text, truncation=True, max_length=keep)["input_ids"]
            return text, self._check_ids(list(ids))
        text, ids = self.tokenize(prompt)
        return text, ids if keep is None else ids[-keep:]

    def make_requests(
        self,
        prompt: ProcessedPrompt,
        engine_requests: list[tuple[str, SamplingParams]],
        priority: int = 0,
    ) -> list[EngineCoreRequest]:
        """The `EngineCoreRequest` of each (id, parameters) of `fan_out`."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}.")
        if not INT64_MIN <= priority <= INT64_MAX:
            raise ValueError(f"priority must be in [{INT64_MIN}, {INT64_MAX}], got {priority}.")
        if priority != 0 and not self.orders_by_priority:
            raise SamplingParamsError(
                "priority",
                f"priority {priority} would be ignored: the scheduling policy "
                f"{self.config.scheduler.policy!r} does not order by priority (start the engine "
                "with --scheduling-policy priority).",
            )
        arrival_time = time.time()
        return [
            EngineCoreRequest(
                request_id=engine_id,
                prompt_token_ids=prompt.token_ids,
                sampling_params=params,
                eos_token_id=self.eos_token_id,
                arrival_time=arrival_time,
                priority=priority,
                cache_salt=prompt.cache_salt,
                mm_items=prompt.mm_items,
                pooling_params=prompt.pooling_params,
            )
            for engine_id, params in engine_requests
        ]
