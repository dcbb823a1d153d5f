"""Front-end output processing: engine-core outputs → detokenized `RequestOutput`s.

Per engine request (one per completion: a request with ``n > 1`` is fanned out into n): the
incremental detokenizer, stop strings (found even across tokens; the earliest-ending one wins;
suppressed until ``min_tokens``), logprobs, and the text held back while streaming so no delta
ever holds the start of a stop string that later matches. Per user request: the n completions
gathered into one `RequestOutput` in the requested output kind. A pooling request ends with one
`EmbeddingRequestOutput`, its pooled vector normalized here when it asks for it.

The only completion of a DELTA request without stop strings or logprobs (a plain stream, the
usual served one) takes a short path per step: its tokens and their text go straight out.

A ``FINAL_ONLY`` completion without stop strings only gathers its tokens (and sampled logprobs)
while it runs: its text is decoded and its logprob entries built once, when it ends (`_settle`),
into the same output the token-by-token path gives.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagellm.engine.detokenizer import make_detokenizer
from pagellm.engine.output_state import CompletionState, RequestState, find_stop_string
from pagellm.engine.processor import ProcessedPrompt
from pagellm.outputs import (
    AnyRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PositionLogprobs,
    RequestOutput,
)
from pagellm.pooling_params import PoolingParams
from pagellm.request import FinishReason
from pagellm.sampling_params import RequestOutputKind, SamplingParams
from pagellm.scheduler.output import EngineCoreOutputs, SampleLogprobs


class OutputProcessor:
    def __init__(self, tokenizer: Any, stream_interval: int = 1) -> None:
        """``stream_interval``: a DELTA request's outputs, but its first and last, wait until
        they carry this many new tokens (fewer, larger stream chunks; 1: one per step)."""
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.requests: dict[str, RequestState] = {}
        self.engine_to_request: dict[str, tuple[RequestState, CompletionState]] = {}
        self.token_texts: dict[int, str] = {}
        """Each token's text on its own, for logprob entries (decoded once per token id)."""

    def add_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        engine_requests: list[tuple[str, SamplingParams]],
    ) -> None:
        """Follow a user request that runs as ``engine_requests`` (`processor.fan_out`)."""
        params = prompt.params
        final_only = params.output_kind == RequestOutputKind.FINAL_ONLY
        completions = []
        for index, (engine_id, cparams) in enumerate(engine_requests):
            detok = (
                make_detokenizer(self.tokenizer, prompt.token_ids, cparams)
                if cparams.detokenize and self.tokenizer is not None
                else None
            )
            completion = CompletionState(
                engine_id, index, cparams, detok, deferred=final_only and not cparams.stop
            )
            if cparams.logprobs is not None:
                completion.logprobs, completion.cumulative_logprob = [], 0.0
            completions.append(completion)
        state = RequestState(
            request_id,
            prompt.text,
            prompt.token_ids,
            params,
            completions,
            pooling=prompt.pooling_params,
        )
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        if len(completions) == 1 and state.pooling is None:
            only = completions[0]
            only.plain_delta = (
                params.output_kind == RequestOutputKind.DELTA
                and not only.params.stop
                and only.logprobs is None
                and state.prompt_logprobs is None
            )
        self.requests[request_id] = state
        for completion in completions:
            self.engine_to_request[completion.engine_id] = (state, completion)

    def engine_ids(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        return [c.engine_id for c in state.completions] if state else []

    def abort_requests(self, request_ids: list[str]) -> list[AnyRequestOutput]:
        outputs = []
        for req_id in request_ids:
            state = self.requests.get(req_id)
            if state is None:
                continue
            for completion in state.completions:
                if completion.finish_reason is None:
                    completion.finish_reason = str(FinishReason.ABORT)
            outputs.append(self._finish(state))
        return outputs

    def process_outputs(
        self, engine_outputs: EngineCoreOutputs
    ) -> tuple[list[AnyRequestOutput], list[str]]:
        """The user-visible outputs of this step, and the engine requests to abort (stopped by a
        stop string, which only the front end can see)."""
        touched: dict[str, RequestState] = {}
        to_abort: list[str] = []
        results: list[AnyRequestOutput] = []
        final_only = RequestOutputKind.FINAL_ONLY
        lookup = self.engine_to_request.get
        for out in engine_outputs.outputs:
            entry = lookup(out.request_id)
            if entry is None:
                continue  # aborted meanwhile
            state, completion = entry
            if (
                completion.plain_delta
                and out.finish_reason is None
                and out.new_token_ids
                and completion.finish_reason is None
            ):
                state.num_cached_tokens = out.num_cached_tokens
                output = self._plain_delta_output(state, completion, out.new_token_ids)
                if output is not None:
                    results.append(output)
                continue
            if completion.finish_reason is not None:
                continue
            state.num_cached_tokens = out.num_cached_tokens
            if out.finish_reason == FinishReason.ERROR:
                # Its step raised: the whole user request fails, its other completions with it.
                completion.finish_reason = str(FinishReason.ERROR)
                for sibling in state.completions:
                    if sibling.finish_reason is None:
                        sibling.finish_reason = str(FinishReason.ABORT)
                        to_abort.append(sibling.engine_id)
                touched.pop(state.request_id, None)
                results.append(self._finish(state))
                continue
            if (
                out.new_prompt_logprobs
                and state.prompt_logprobs is not None
                and completion.index == 0
            ):
                state.prompt_logprobs.extend(
                    self._position_logprobs(s) for s in out.new_prompt_logprobs
                )
            if out.pooled is not None:  # a pooling request: one output, its end
                state.pooled = out.pooled
                completion.finish_reason = str(FinishReason.STOP)
                results.append(self._finish(state))
                continue
            if not out.new_token_ids:
                continue  # a prefill chunk: its prompt logprobs wait for the first token
            if completion.deferred:  # no stop strings to look for: text and logprobs wait
                completion.token_ids += out.new_token_ids
                if out.new_logprobs and completion.logprobs is not None:
                    completion.samples += out.new_logprobs
                stopped = False
            else:
                stopped = self._add_tokens(completion, out.new_token_ids, out.new_logprobs)
            if stopped:
                to_abort.append(completion.engine_id)
            elif out.finish_reason is not None:
                completion.finish_reason = str(FinishReason(out.finish_reason))
                completion.stop_reason = out.stop_reason
            if len(state.completions) == 1:  # its output is complete for this step: emit now
                if completion.finish_reason is not None:
                    results.append(self._finish(state))
                elif state.params.output_kind != final_only and self._due(state):
                    results.append(self._make_output(state))
            else:  # n > 1: wait until every completion of the step is in
                touched[state.request_id] = state
        for state in touched.values():
            if state.finished:
                results.append(self._finish(state))
            elif state.params.output_kind != final_only and self._due(state):
                results.append(self._make_output(state))
        return results, to_abort

    def _due(self, state: RequestState) -> bool:
        """Whether an unfinished request's output goes out now: always, but for a DELTA request
        under a `stream_interval`, whose first output does and later ones once a completion has
        that many new tokens."""
        interval = self.stream_interval
        if interval == 1 or state.params.output_kind != RequestOutputKind.DELTA:
            return True
        return not state.output_sent or any(
            len(c.token_ids) - c.sent_tokens >= interval for c in state.completions
        )

    def _add_tokens(
        self,
        completion: CompletionState,
        token_ids: list[int],
        logprobs: list[SampleLogprobs] | None,
    ) -> bool:
        """Returns True when a stop string ended the completion."""
        completion.token_ids.extend(token_ids)
        params = completion.params
        if logprobs and completion.logprobs is not None:
            for sample in logprobs:
                completion.logprobs.append(self._position_logprobs(sample))
                completion.cumulative_logprob = (
                    completion.cumulative_logprob or 0.0
                ) + sample.logprobs[0]
        if completion.detokenizer is None:
            return False
        new_text = completion.detokenizer.update(token_ids)
        completion.text += new_text
        if not params.stop or not new_text or len(completion.token_ids) < params.min_tokens:
            return False
        stops = [params.stop] if isinstance(params.stop, str) else params.stop
        found = find_stop_string(
            completion.text, len(new_text), stops, params.include_stop_str_in_output
        )
        if found is None:
            return False
        completion.stop_reason, cut = found
        completion.text = completion.text[:cut]
        completion.finish_reason = str(FinishReason.STOP)
        return True

    def _plain_delta_output(
        self, state: RequestState, completion: CompletionState, token_ids: list[int]
    ) -> RequestOutput | None:
        """A streamed token's path (`CompletionState.plain_delta`, not finishing): what
        `_add_tokens` and `_make_output` give there, without their checks (nothing is held
        back); None while a `stream_interval` keeps the tokens waiting."""
        sent_tokens = completion.sent_tokens
        caught_up = sent_tokens == len(completion.token_ids)  # all before these went out
        completion.token_ids += token_ids
        detokenizer = completion.detokenizer
        text = detokenizer.update(token_ids) if detokenizer is not None else ""
        if text:
            completion.text += text
        interval = self.stream_interval
        if interval > 1 and sent_tokens and len(completion.token_ids) - sent_tokens < interval:
            return None
        if not caught_up:
            text = completion.text[completion.sent_chars :]
            token_ids = completion.token_ids[sent_tokens:]
        completion.sent_chars = len(completion.text)
        completion.sent_tokens = len(completion.token_ids)
        state.output_sent = True
        return RequestOutput(
            state.request_id,
            state.prompt,
            state.prompt_token_ids,
            [CompletionOutput(completion.index, text, list(token_ids), None, None)],
            False,
            None,
            state.num_cached_tokens,
        )

    def _position_logprobs(self, sample: SampleLogprobs) -> PositionLogprobs:
        position: PositionLogprobs = {}
        texts, tokenizer = self.token_texts, self.tokenizer
        for rank, (tok, lp) in enumerate(zip(sample.token_ids, sample.logprobs, strict=True)):
            if tok not in position:
                decoded = None
                if tokenizer is not None:
                    decoded = texts.get(tok)
                    if decoded is None:
                        decoded = texts[tok] = tokenizer.decode([tok])
                position[tok] = Logprob(lp, sample.sampled_rank if rank == 0 else rank, decoded)
        return position

    def _settle(self, completion: CompletionState) -> None:
        """A deferred completion's text and logprob entries, made once from all its tokens."""
        completion.deferred = False
        if completion.detokenizer is not None:
            completion.text = completion.detokenizer.decode_all(completion.token_ids)
        if completion.logprobs is not None:
            cumulative = 0.0
            for sample in completion.samples:
                completion.logprobs.append(self._position_logprobs(sample))
                cumulative += sample.logprobs[0]  # in order: the sum the per-token path makes
            completion.cumulative_logprob = cumulative
            completion.samples = []

    def _finish(self, state: RequestState) -> AnyRequestOutput:
        del self.requests[state.request_id]
        for completion in state.completions:
            self.engine_to_request.pop(completion.engine_id, None)
            if completion.deferred:
                self._settle(completion)
        if state.pooling is not None:
            return self._embedding_output(state, state.pooling)
        return self._make_output(state)

    @staticmethod
    def _embedding_output(state: RequestState, params: PoolingParams) -> EmbeddingRequestOutput:
        """The pooled vector, L2-normalized when the request's ``normalize`` says so (float32,
        as ``torch.nn.functional.normalize`` does it)."""
        vector = np.frombuffer(state.pooled, dtype=np.float32)
        if params.normalize and len(vector):
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        return EmbeddingRequestOutput(
            request_id=state.request_id,
            prompt_token_ids=state.prompt_token_ids,
            outputs=EmbeddingOutput(vector.tolist()),
            finished=True,
            prompt=state.prompt,
            finish_reason=state.completions[0].finish_reason,
        )

    def _make_output(self, state: RequestState) -> RequestOutput:
        delta = state.params.output_kind == RequestOutputKind.DELTA
        completions = []
        for c in state.completions:
            has_logprobs = c.logprobs is not None
            visible = len(c.text) - c.holdback
            if delta:
                sent_chars = c.sent_chars
                text = c.text[sent_chars:visible] if visible > sent_chars else ""
                token_ids = c.token_ids[c.sent_tokens :]
                logprobs = c.logprobs[c.sent_logprobs :] if has_logprobs else None  # type: ignore[index]
                if c.sent_finish or (not text and not token_ids and c.finish_reason is None):
                    continue  # nothing new for this completion
                c.sent_finish = c.finish_reason is not None
            else:
                text = c.text[: max(visible, 0)]
                token_ids = list(c.token_ids)
                logprobs = list(c.logprobs) if has_logprobs else None  # type: ignore[arg-type]
            if visible > c.sent_chars:
                c.sent_chars = visible
            c.sent_tokens = len(c.token_ids)
            if has_logprobs:
                c.sent_logprobs = len(c.logprobs)  # type: ignore[arg-type]
            completions.append(
                CompletionOutput(
                    c.index,
                    text,
                    token_ids,
                    c.cumulative_logprob,
                    logprobs,
                    c.finish_reason,
                    c.stop_reason,
                )
            )
        prompt_logprobs = state.prompt_logprobs
        if delta and state.output_sent:
            prompt_logprobs = None
        state.output_sent = True
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=state.finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
        )
