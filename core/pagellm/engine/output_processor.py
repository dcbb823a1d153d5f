"""Front-end output processing: engine-core outputs → detokenized `RequestOutput`s."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagellm.engine.detokenizer import IncrementalDetokenizer
from pagellm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from pagellm.request import FinishReason
from pagellm.sampling_params import SamplingParams
from pagellm.scheduler.output import EngineCoreOutputs


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        detok = (
            IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
            if params.detokenize
            else None
        )
        state = RequestState(request_id, prompt, prompt_token_ids, params, detok)
        if params.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        self.requests[request_id] = state

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = []
        for req_id in request_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                outputs.append(self._make_output(state, str(FinishReason.ABORT), None))
        return outputs

    def process_outputs(self, engine_outputs: EngineCoreOutputs) -> list[RequestOutput]:
        results = []
        for out in engine_outputs.outputs:
            state = self.requests.get(out.request_id)
            if state is None:
                continue  # aborted meanwhile
            state.token_ids.extend(out.new_token_ids)
            if state.detokenizer is not None:
                state.detokenizer.update(out.new_token_ids)
            if out.new_logprobs and state.logprobs is not None:
                for sample in out.new_logprobs:
                    state.logprobs.append(
                        self._position_logprobs(
                            sample.token_ids, sample.logprobs, sample.sampled_rank
                        )
                    )
                    state.cumulative_logprob = (state.cumulative_logprob or 0.0) + sample.logprobs[
                        0
                    ]
            finish = str(FinishReason(out.finish_reason)) if out.finish_reason is not None else None
            if finish is not None:
                del self.requests[out.request_id]
            results.append(self._make_output(state, finish, out.stop_reason))
        return results

    def _position_logprobs(
        self, token_ids: list[int], logprobs: list[float], sampled_rank: int
    ) -> PositionLogprobs:
        position: PositionLogprobs = {}
        for rank, (tok, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
            if tok in position:
                continue
            position[tok] = Logprob(
                lp, sampled_rank if rank == 0 else rank, self.tokenizer.decode([tok])
            )
        return position

    @staticmethod
    def _make_output(
        state: RequestState, finish_reason: str | None, stop_reason: int | str | None
    ) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=state.detokenizer.output_text if state.detokenizer else "",
            token_ids=list(state.token_ids),
            cumulative_logprob=state.cumulative_logprob,
            logprobs=list(state.logprobs) if state.logprobs is not None else None,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=finish_reason is not None,
        )
