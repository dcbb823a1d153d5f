"""The scheduler: a token budget spread over running requests first, then waiting ones.

There is no prefill or decode phase. Each request's ``num_computed_tokens`` catches up with its
``num_tokens``; a step gives each request as many tokens as the budget, the long-prefill
threshold and the KV cache allow (chunked prefill falls out of this). When the cache is full a
running request is preempted: its blocks are freed and it is recomputed later from scratch.

A step that raised (`fail_step`) must not take the other requests down with the one that made it
fail: a lone request is failed; the requests of a larger step are set back to be recomputed,
then run one at a time (each one the only request of its steps, a *probe*, until it samples a
token), so the one that fails again alone is failed, and the others go on.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable

from pagellm.config import SchedulerConfig
from pagellm.kv_cache.manager import KVCacheManager
from pagellm.request import FinishReason, Request, RequestStatus
from pagellm.scheduler.output import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    NewRequestData,
    RequestEvent,
    RequestEventType,
    SchedulerOutput,
)
from pagellm.scheduler.policy import SchedulingPolicy, scheduling_policies

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        # The scheduling policy holds the waiting requests and picks preemption victims.
        self.waiting: SchedulingPolicy = scheduling_policies.get(config.policy)()
        self.running: list[Request] = []
        # Requests that ended since the last schedule(): the workers must drop their state.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        # After a failed step: requests waiting to run alone, and the one that runs alone now.
        self.quarantine: deque[Request] = deque()
        self.probe: Request | None = None
        # Requests the workers dropped after a failed step: sent whole when next scheduled.
        self.resend: set[str] = set()
        # Queued and first-scheduled events since `take_events` (for the front end's metrics).
        self.events: list[RequestEvent] = []

    # ---------------------------------------------------------------- requests in and out

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"A request with id {request.request_id!r} is already in the engine.")
        room = self.config.max_model_len - request.num_prompt_tokens
        request.max_tokens = min(request.max_tokens or room, room)
        self.requests[request.request_id] = request
        self.waiting.add(request)
        self.events.append(
            RequestEvent(request.request_id, RequestEventType.QUEUED, time.monotonic())
        )

    def take_events(self) -> list[RequestEvent]:
        """The request events since the last call."""
        events, self.events = self.events, []
        return events

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside the step loop (abort); unknown or finished ids are ignored
        (a finished request has left ``requests``)."""
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request in self.quarantine:
                self.quarantine.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)

    def _free_request(self, request: Request, num_valid_tokens: int | None = None) -> None:
        self.kv_cache_manager.free(request, num_valid_tokens)
        self.finished_req_ids.add(request.request_id)
        self.resend.discard(request.request_id)
        if self.probe is request:
            self.probe = None
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.quarantine)

    # ---------------------------------------------------------------- one step

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        kv = self.kv_cache_manager
        token_budget = cfg.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_block_ids: dict[str, list[int]] = {}
        scheduled_running: list[Request] = []
        scheduled_new: list[Request] = []
        preempted: list[Request] = []
        if self.probe is None and self.quarantine:
            self.probe = self.quarantine.popleft()
            self.probe.status = RequestStatus.RUNNING
            self.running.append(self.probe)

        # 1. Running requests, in order (only the probe while there is one).
        running = self.running if self.probe is None else [self.probe]
        cap = cfg.long_prefill_token_threshold
        i = 0
        while i < len(running) and token_budget > 0:
            request = running[i]
            if request.num_output_placeholders and self._ends_in_flight(request):
                i += 1  # the token in flight is its last one: no step for it beyond
                continue
            # The tokens it still needs, capped by the long-prefill threshold and the budget.
            num_new = request.num_tokens + request.num_output_placeholders
            num_new -= request.num_computed_tokens
            if cap and num_new > cap:
                num_new = cap
            if num_new > token_budget:
                num_new = token_budget
            if num_new == 0:
                i += 1
                continue
            while True:
                blocks = kv.allocate_slots(request, num_new)
                if blocks is not None:
                    break
                victim = self._pick_victim()
                victim_index = running.index(victim) if victim in running else len(running)
                self.running.remove(victim)
                scheduled_this_step = victim.request_id in num_scheduled
                if scheduled_this_step:
                    # Already scheduled this step: give back what it took.
                    token_budget += num_scheduled.pop(victim.request_id)
                    new_block_ids.pop(victim.request_id, None)
                    scheduled_running.remove(victim)
                self._preempt(victim, scheduled_this_step)
                preempted.append(victim)
                if victim_index < i:
                    i -= 1
                if victim is request:
                    break
            if blocks is None:
                continue  # the request preempted itself; `i` already points at the next one
            if self.resend and request.request_id in self.resend:
                scheduled_new.append(request)  # the probe, dropped by the workers: sent whole
            else:
                scheduled_running.append(request)
            num_scheduled[request.request_id] = num_new
            new_block_ids[request.request_id] = [b.block_id for b in blocks] if blocks else []
            token_budget -= num_new
            i += 1

        # 2. Waiting requests, unless this step had to preempt (the cache is short of room).
        scheduled_resumed: list[Request] = []
        if not preempted and self.probe is None:
            now = time.monotonic()
            while len(self.waiting) and token_budget > 0 and len(self.running) < cfg.max_num_seqs:
                request = self.waiting.peek()
                hits, num_hit_tokens = kv.get_computed_blocks(request)
                num_new = request.num_tokens - num_hit_tokens
                if cfg.long_prefill_token_threshold:
                    num_new = min(num_new, cfg.long_prefill_token_threshold)
                if not cfg.enable_chunked_prefill and num_new > token_budget:
                    break
                num_new = min(num_new, token_budget)
                blocks = kv.allocate_slots(request, num_new, num_hit_tokens, hits)
                if blocks is None:
                    break
                self.waiting.pop()
                if request.status == RequestStatus.WAITING:  # its first scheduling
                    self.events.append(
                        RequestEvent(request.request_id, RequestEventType.SCHEDULED, now)
                    )
                resumed = request.status == RequestStatus.PREEMPTED
                resumed = resumed and request.request_id not in self.resend
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_hit_tokens
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit_tokens
                self.running.append(request)
                if resumed:  # the workers kept its state: it comes back with its whole block list
                    scheduled_resumed.append(request)
                    new_block_ids[request.request_id] = kv.get_block_ids(request.request_id)
                else:
                    scheduled_new.append(request)
                num_scheduled[request.request_id] = num_new
                token_budget -= num_new

        cached = scheduled_running + scheduled_resumed
        output = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData(
                    req_id=r.request_id,
                    prompt_token_ids=r.prompt_token_ids,
                    sampling_params=r.sampling_params,
                    block_ids=kv.get_block_ids(r.request_id),
                    num_computed_tokens=r.num_computed_tokens,
                    eos_token_id=None if r.sampling_params.ignore_eos else r.eos_token_id,
                    output_token_ids=list(r.output_token_ids),
                    mm_items=r.mm_items,
                )
                for r in scheduled_new
            ],
            scheduled_cached_reqs=CachedRequestData(
                req_ids=[r.request_id for r in cached],
                resumed_from_preemption=[False] * len(scheduled_running)
                + [True] * len(scheduled_resumed),
                new_block_ids=[new_block_ids[r.request_id] for r in cached],
                num_computed_tokens=[r.num_computed_tokens for r in cached],
            ),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=cfg.max_num_batched_tokens - token_budget,
            preempted_req_ids={r.request_id for r in preempted},
            finished_req_ids=self.finished_req_ids,
        )
        for request in itertools.chain(cached, scheduled_new):
            request.num_computed_tokens += num_scheduled[request.request_id]
            if request.num_computed_tokens == request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1  # it samples this step
        if self.resend:
            self.resend.difference_update(r.request_id for r in scheduled_new)
        self.finished_req_ids = set()
        return output

    def _ends_in_flight(self, request: Request) -> bool:
        """Whether the tokens in flight will bring the request to its length limit."""
        num_output = len(request.output_token_ids) + request.num_output_placeholders
        num_tokens = request.num_tokens + request.num_output_placeholders
        return num_output >= (request.max_tokens or 0) or num_tokens >= self.config.max_model_len

    def _pick_victim(self) -> Request:
        """The running request to preempt; never the probe (it must run to tell its fault)."""
        candidates = self.running
        if self.probe is not None:
            candidates = [r for r in candidates if r is not self.probe] or candidates
        return self.waiting.pick_victim(candidates)

    def _preempt(self, request: Request, scheduled_this_step: bool = False) -> None:
        # Blocks it registered this step will not be computed: keep them out of the prefix cache.
        valid = request.num_computed_tokens if scheduled_this_step else None
        self.kv_cache_manager.free(request, num_valid_tokens=valid)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    # ---------------------------------------------------------------- after the forward pass

    def update_from_output(self, runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        if runner_output.pooled is not None:
            return self._update_from_pooled(runner_output.req_ids, runner_output.pooled)
        outputs: list[EngineCoreOutput] = []
        requests, running = self.requests, RequestStatus.RUNNING
        all_prompt_logprobs = runner_output.prompt_logprobs
        all_logprobs = runner_output.logprobs
        finished: list[Request] = []
        for index, (req_id, new_token_ids) in enumerate(
            zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True)
        ):
            request = requests.get(req_id)
            if request is None:
                continue  # aborted while the step ran
            prompt_logprobs = all_prompt_logprobs.get(req_id) if all_prompt_logprobs else None
            if not new_token_ids:
                if prompt_logprobs:  # a prefill chunk: only its prompt logprobs to pass on
                    outputs.append(
                        EngineCoreOutput(req_id, [], new_prompt_logprobs=prompt_logprobs)
                    )
                continue
            # A request preempted after this step was launched (one step in flight) keeps it:
            # it is admitted again only once that token is known (not in the step that preempted).
            was_running = request.status == running
            request.num_output_placeholders -= 1
            token = new_token_ids[0]  # the runner samples one token per request and step
            request.append_output_token(token)
            self._check_stop(request, token)
            sample_logprobs = all_logprobs[index] if all_logprobs else None
            finish = request.get_finish_reason()
            outputs.append(
                EngineCoreOutput(
                    req_id,
                    new_token_ids,
                    [sample_logprobs] if sample_logprobs is not None else None,
                    int(finish) if finish is not None else None,
                    request.stop_reason,
                    request.num_cached_tokens,
                    prompt_logprobs,
                )
            )
            if request is self.probe:
                self.probe = None  # it ran alone up to a sampled token: it was not the fault
            if finish is not None:
                if was_running:
                    finished.append(request)
                else:  # preempted while its last token was in flight: it waits, not runs
                    self.waiting.remove(request)
                self._free_request(request)
        if finished:  # one pass over the running list, however many requests ended
            gone = set(finished)
            self.running[:] = [r for r in self.running if r not in gone]
        return EngineCoreOutputs(outputs=outputs)

    def _update_from_pooled(self, req_ids: list[str], pooled: list[bytes]) -> EngineCoreOutputs:
        """A pooling model's step: each request ran over its whole prompt and ends with its vector
        (one preempted after the step was launched too: the step computed it whole)."""
        outputs: list[EngineCoreOutput] = []
        finished: set[Request] = set()
        stop = int(FinishReason.STOP)
        for req_id, vector in zip(req_ids, pooled, strict=True):
            request = self.requests.get(req_id)
            if request is None:
                continue  # aborted while the step ran
            request.num_output_placeholders = 0
            if request.status == RequestStatus.RUNNING:
                finished.add(request)
            else:
                self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_STOPPED
            cached = request.num_cached_tokens
            outputs.append(EngineCoreOutput(req_id, [], None, stop, None, cached, None, vector))
            if request is self.probe:
                self.probe = None  # it ran alone to its end: it was not the fault
            self._free_request(request)
        self.running[:] = [r for r in self.running if r not in finished]
        return EngineCoreOutputs(outputs=outputs)

    def fail_step(self, scheduler_output: SchedulerOutput) -> EngineCoreOutputs:
        """The workers raised running ``scheduler_output`` and dropped every request it named
        (`Worker.drop_requests`). A step of one request fails it; the requests of a larger step
        are recomputed one at a time (see the module docstring). Returns the failed requests'
        outputs (finish reason ERROR)."""
        # Under asynchronous scheduling, requests the step before it finished have left.
        scheduled = [
            request
            for r in scheduler_output.num_scheduled_tokens
            if (request := self.requests.get(r)) is not None
            and request.status == RequestStatus.RUNNING
        ]
        alone = len(scheduler_output.num_scheduled_tokens) == 1
        # Requests it preempted: the workers dropped their state too, so they come back whole.
        self.resend.update(r for r in scheduler_output.preempted_req_ids if r in self.requests)
        outputs: list[EngineCoreOutput] = []
        for request in scheduled:
            # The K/V this step was to write are not valid: keep them out of the prefix cache.
            valid = (
                request.num_computed_tokens
                - scheduler_output.num_scheduled_tokens[request.request_id]
            )
            self.running.remove(request)
            request.num_output_placeholders = 0  # the step sampled nothing
            if alone:
                request.status = RequestStatus.FINISHED_ERROR
                self._free_request(request, valid)
                outputs.append(
                    EngineCoreOutput(request.request_id, [], finish_reason=int(FinishReason.ERROR))
                )
                continue
            self.kv_cache_manager.free(request, num_valid_tokens=valid)
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            if request is self.probe:
                self.probe = None
            self.quarantine.append(request)
            self.resend.add(request.request_id)
        return EngineCoreOutputs(outputs=outputs)

    def _check_stop(self, request: Request, token_id: int) -> None:
        """Finish the request if ``token_id``, just appended, ends it: a stop token once
        ``min_tokens`` are out (the sampler keeps them out until then), else its length."""
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        max_tokens = request.max_tokens or 0
        if num_output > params.min_tokens or num_output >= max_tokens:
            if token_id == request.eos_token_id and not params.ignore_eos:
                request.status = RequestStatus.FINISHED_STOPPED
                return
            if params.stop_token_ids and token_id in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return
        if num_output >= max_tokens or request.num_tokens >= self.config.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
