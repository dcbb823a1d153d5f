"""`LLM`: the offline API (vLLM-compatible): build an engine once, then `generate` / `chat`, or
`embed` for a model served by the pooling runner."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar, cast

import msgspec
from tqdm.auto import tqdm

from pagellm.engine.args import EngineArgs
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.processor import ProcessedPrompt, PromptType
from pagellm.outputs import AnyRequestOutput, EmbeddingRequestOutput, RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import RequestOutputKind, SamplingParams

ChatMessage = dict[str, Any]
T = TypeVar("T")


# Chat content parts that carry an image: the part's key holds it (an image_url part's value is
# {"url": ...} or the URL; an image_pil part's, a PIL image).
_IMAGE_PARTS = ("image_url", "image_pil")


def _with_placeholders(
    conversation: list[ChatMessage], placeholders: Mapping[str, str]
) -> tuple[list[ChatMessage], list[Any]]:
    """The conversation with each message's content parts joined into one text (an image part
    as the IO processor's placeholder for ``image_url`` parts), and its images in order."""
    messages, images = [], []
    for message in conversation:
        content = message.get("content")
        if not isinstance(content, list):
            messages.append(message)
            continue
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                texts.append(part["text"])
                continue
            if kind not in _IMAGE_PARTS:
                raise ValueError(f"A chat content part of type {kind!r} is not supported.")
            if "image_url" not in placeholders:
                raise ValueError(
                    f"A chat content part of type {kind!r} needs a model that takes images, "
                    "with its IO processor (pagellm-io-image); this engine has none."
                )
            value = part[kind]
            images.append(value["url"] if isinstance(value, dict) else value)
            texts.append(placeholders["image_url"])
        messages.append({**message, "content": "\n".join(texts)})
    return messages, images


def _one_each(name: str, value: T | Sequence[T], count: int) -> list[T]:
    """``value`` for each of ``count`` prompts, or a sequence of one value per prompt."""
    if not isinstance(value, Sequence):
        return [value] * count
    if len(value) != count:
        raise ValueError(f"{name} has {len(value)} entries for {count} prompts.")
    return list(value)


class LLM:
    def __init__(self, model: str, **engine_kwargs: Any) -> None:
        """``engine_kwargs``: fields of `EngineArgs` (``max_model_len=2048``, ``dtype="float32"``)."""
        fields = {f.name for f in dataclasses.fields(EngineArgs)} - {"model"}
        unknown = sorted(set(engine_kwargs) - fields)
        if unknown:
            raise TypeError(
                f"LLM() got unknown engine argument(s) {', '.join(unknown)}; it takes the fields "
                f"of EngineArgs: {', '.join(sorted(fields))}."
            )
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model, **engine_kwargs))
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use without sampling parameters: `SamplingParams()` with
        the model's generation config defaults (``generation_config``, as in vLLM)."""
        return SamplingParams(**self.llm_engine.config.model.default_sampling)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts.

        Every prompt is validated before any is queued, so one bad prompt raises ``ValueError``
        and leaves the engine as it was. ``priority``: one per prompt (lower runs first with
        ``scheduling_policy="priority"``); a prompt dict may carry a ``cache_salt``.
        """
        prompt_list = self._as_prompt_list(prompts)
        count = len(prompt_list)
        default = self.get_default_sampling_params() if sampling_params is None else sampling_params
        params_list = _one_each("sampling_params", default, count)
        priorities = _one_each("priority", 0 if priority is None else priority, count)
        engine = self.llm_engine
        # Every prompt is processed (tokenized and validated) before any is queued. Only finished
        # outputs are returned: no need to build intermediate ones.
        processed = [
            engine.processor.process(
                prompt, msgspec.structs.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
            )
            for prompt, p in zip(prompt_list, params_list, strict=True)
        ]
        return cast(list[RequestOutput], self._run(processed, priorities, use_tqdm))

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``output.outputs.embedding``), in the order of the prompts,
        from a model served by the pooling runner (``runner="pooling"``, the default for an
        embedding model such as BertModel). Every prompt is validated before any is queued.
        ``truncate_prompt_tokens`` (-1: ``max_model_len``) applies to prompts whose params do
        not set it."""
        prompt_list = self._as_prompt_list(prompts)
        count = len(prompt_list)
        default = PoolingParams() if pooling_params is None else pooling_params
        params_list = _one_each("pooling_params", default, count)
        if truncate_prompt_tokens is not None:
            params_list = [
                p
                if p.truncate_prompt_tokens is not None
                else msgspec.structs.replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
                for p in params_list
            ]
        priorities = _one_each("priority", 0 if priority is None else priority, count)
        processor = self.llm_engine.processor
        processed = [
            processor.process_pooling(prompt, p)
            for prompt, p in zip(prompt_list, params_list, strict=True)
        ]
        return cast(list[EmbeddingRequestOutput], self._run(processed, priorities, use_tqdm))

    def _run(
        self, processed: list[ProcessedPrompt], priorities: list[int], use_tqdm: bool
    ) -> list[AnyRequestOutput]:
        engine = self.llm_engine
        request_ids = [str(next(self._request_counter)) for _ in processed]
        for req_id, prompt, prio in zip(request_ids, processed, priorities, strict=True):
            engine.add_request(req_id, prompt, priority=prio)
        return self._run_engine(request_ids, use_tqdm)

    def chat(
        self,
        messages: list[ChatMessage] | list[list[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the tokenizer's chat
        template. A message's content may be a list of parts (OpenAI's): ``text``, and for a
        model that takes images ``image_url`` (``{"url": data or file URL}``) or ``image_pil``
        (a PIL image), rendered as the IO processor's placeholder."""
        self.llm_engine.processor.check_generates()  # before the chat template is looked for
        conversations = cast(
            list[list[ChatMessage]],
            [messages] if messages and isinstance(messages[0], dict) else messages,
        )
        tokenizer = self.get_tokenizer()
        io = self.llm_engine.io_processor
        placeholders = io.chat_placeholders if io is not None else {}
        prompts: list[PromptType] = []
        for conversation in conversations:
            rendered, images = _with_placeholders(conversation, placeholders)
            ids = tokenizer.apply_chat_template(
                rendered,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
            )
            prompt: dict[str, Any] = {"prompt_token_ids": list(ids)}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    @staticmethod
    def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompt_list = list(prompts)
        if prompt_list and all(isinstance(t, int) for t in prompt_list):
            return [prompt_list]  # type: ignore[list-item]  # one prompt given as token ids
        if not prompt_list:
            raise ValueError("prompts is empty.")
        return prompt_list  # type: ignore[return-value]

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[AnyRequestOutput]:
        engine = self.llm_engine
        finished: dict[str, AnyRequestOutput] = {}
        pending = set(request_ids)
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while pending:
                for output in engine.step():
                    if output.finished and output.request_id in pending:
                        finished[output.request_id] = output
                        pending.discard(output.request_id)
                        bar.update(1)
        except BaseException:
            engine.abort_request(list(pending))
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]
