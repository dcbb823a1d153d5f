"""`LLM`: the offline API (vLLM-compatible): build an engine once, then `generate` / `chat`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import msgspec
from tqdm.auto import tqdm

from pagellm.config import LoadFormat
from pagellm.engine.args import DTypeArg, EngineArgs
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.processor import PromptType
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import RequestOutputKind, SamplingParams

ChatMessage = dict[str, Any]


class LLM:
    def __init__(
        self,
        model: str,
        tokenizer: str | None = None,
        dtype: DTypeArg = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        block_size: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        load_format: LoadFormat = "auto",
        kv_cache_memory: int | None = None,
        **kwargs: Any,
    ) -> None:
        args = EngineArgs(
            model=model,
            tokenizer=tokenizer,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            load_format=load_format,
            kv_cache_memory=kv_cache_memory,
            **kwargs,
        )
        self.llm_engine = LLMEngine.from_engine_args(args)
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts.

        Every prompt is validated before any is queued, so one bad prompt raises ``ValueError``
        and leaves the engine as it was.
        """
        prompt_list = self._as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries for {len(prompt_list)} prompts."
                )
        priorities = priority or [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError(
                f"priority has {len(priorities)} entries for {len(prompt_list)} prompts."
            )
        engine = self.llm_engine
        for prompt, params in zip(prompt_list, params_list, strict=True):
            engine.validate_request(prompt, params)

        # Only finished outputs are returned: no need to build intermediate ones.
        params_list = [
            msgspec.structs.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
            for p in params_list
        ]
        request_ids = [str(next(self._request_counter)) for _ in prompt_list]
        for req_id, prompt, params, prio in zip(
            request_ids, prompt_list, params_list, priorities, strict=True
        ):
            engine.add_request(req_id, prompt, params, priority=prio)
        return self._run_engine(request_ids, use_tqdm)

    def chat(
        self,
        messages: list[ChatMessage] | list[list[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the tokenizer's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conversation in conversations:
            ids = tokenizer.apply_chat_template(
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
            )
            prompts.append({"prompt_token_ids": list(ids)})
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

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
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
