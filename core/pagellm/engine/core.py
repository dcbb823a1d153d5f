"""The engine core: scheduler + executor, advanced one `step()` at a time."""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from collections.abc import Iterable

import msgspec

from pagellm.config import EngineConfig
from pagellm.engine.warm_up import warm_up
from pagellm.executor.abstract import Executor
from pagellm.executor.errors import ExecutorDeadError
from pagellm.executor.selection import executor_class
from pagellm.kv_cache.hashing import make_block_hasher
from pagellm.kv_cache.manager import KVCacheManager, cdiv
from pagellm.kv_cache.residency import KVBlockResidency
from pagellm.metrics.stats import SchedulerStats
from pagellm.platforms import current_platform
from pagellm.request import EngineCoreRequest, Request, RequestStatus
from pagellm.sampling_params import SamplingParams
from pagellm.scheduler.output import EngineCoreOutput, EngineCoreOutputs, SchedulerOutput
from pagellm.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

# Steps that raise one after the other even when their requests run alone: the engine is broken.
MAX_FAILED_STEPS_IN_A_ROW = 32


def needs_host_tokens(params: SamplingParams) -> str | None:
    """Why a request's steps cannot be planned before its last sampled token is on the host
    (asynchronous scheduling then runs its steps synchronously), or None. Multi-token bad words:
    a word's last token is banned once the output ends with the rest of the word, which the
    sampler reads from the host's copy of the tokens. (Stop strings need no such care: they are
    checked after the fact and the tokens sampled past them are dropped.)"""
    if any(len(word) > 1 for word in params.bad_words_token_ids or ()):
        return "multi-token bad_words (the sampler reads the output's last tokens on the host)"
    return None


class EngineCore:
    def __init__(self, config: EngineConfig, executor_cls: type[Executor] | None = None) -> None:
        """``executor_cls``: default, the one ``config.parallel`` names (`executor_class`)."""
        self.config = config
        start = time.perf_counter()
        self.executor = (executor_cls or executor_class(config.parallel))(config)
        workers_ready = time.perf_counter()
        num_blocks, capture_seconds = self._initialize_kv_cache()
        cache_ready = time.perf_counter()
        if current_platform.needs_warm_up:
            warm_up(config, self.executor, num_blocks)
        ready = time.perf_counter()
        logger.info(
            "Engine core ready in %.1f s: workers and weights %.1f s, memory profiling and KV "
            "cache %.1f s%s, warm-up %.1f s",
            ready - start,
            workers_ready - start,
            cache_ready - workers_ready - sum(capture_seconds.values()),
            "".join(f", {kind} {seconds:.1f} s" for kind, seconds in capture_seconds.items()),
            ready - cache_ready,
        )
        self.num_steps = 0
        self._last_step = SchedulerStats()
        """What the last step scheduled (the rest of the stats are read when they are sent)."""
        self.num_failed_steps_in_a_row = 0
        # Everything built so far (model, graphs) lives as long as the engine: keep it out of the
        # garbage collector's scans, which would otherwise stall steps at random. The block pool,
        # built below, stays unfrozen on purpose: frozen, it would leave the watched heap so small
        # that full collections came far more often (docs/benchmarks.md, 2026-12-02).
        gc.collect()
        gc.freeze()
        block_size = config.cache.block_size
        observability = config.observability
        self.kv_block_residency = (
            KVBlockResidency(observability.kv_cache_metrics_sample)
            if observability.kv_cache_metrics
            else None
        )
        self.kv_cache_manager = KVCacheManager(
            block_size, num_blocks, config.cache.enable_prefix_caching, self.kv_block_residency
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager)
        self.block_hasher = (
            make_block_hasher(block_size) if config.cache.enable_prefix_caching else None
        )
        self.async_scheduling = config.scheduler.async_scheduling
        self.in_flight: deque[SchedulerOutput] = deque()
        """Steps launched and not collected yet (asynchronous scheduling: one between steps)."""
        self._host_sync: dict[str, str] = {}
        """Requests whose steps must not overlap (`needs_host_tokens`), with the reason."""
        self._logged_sync_reasons: set[str] = set()

    def _initialize_kv_cache(self) -> tuple[int, dict[str, float]]:
        """Size and allocate the KV cache, then capture the graphs: the number of blocks, and
        the seconds each kind of graph took to capture."""
        cfg = self.config
        spec = self.executor.get_kv_cache_spec()
        available = self.executor.determine_available_memory()
        bytes_per_block = spec.page_size_bytes * cfg.model.num_layers
        num_blocks = available // bytes_per_block
        needed = cdiv(cfg.model.max_model_len, spec.block_size) + 1  # +1: the null block
        if num_blocks < needed:
            raise ValueError(
                f"The KV cache ({available / 2**20:.1f} MiB, {num_blocks} blocks of {spec.block_size} "
                f"tokens at {bytes_per_block / 2**10:.1f} KiB each) cannot hold one request of "
                f"max_model_len={cfg.model.max_model_len} (needs {needed} blocks, "
                f"{needed * bytes_per_block / 2**20:.1f} MiB). Give it more memory (kv_cache_memory / "
                "gpu_memory_utilization) or lower max_model_len."
            )
        capture_seconds = self.executor.initialize_cache(num_blocks)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB), kv cache dtype %s (%s)",
            num_blocks,
            spec.block_size,
            num_blocks * spec.block_size,
            num_blocks * bytes_per_block / 2**20,
            cfg.cache.cache_dtype,
            str(spec.storage_dtype).removeprefix("torch."),
        )
        return num_blocks, capture_seconds

    def add_request(self, request: EngineCoreRequest) -> None:
        fields = msgspec.structs.asdict(request)
        self.scheduler.add_request(Request(**fields, block_hasher=self.block_hasher))
        reason = needs_host_tokens(request.sampling_params) if self.async_scheduling else None
        if reason is not None:
            self._host_sync[request.request_id] = reason

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.in_flight)

    def step(self) -> EngineCoreOutputs:
        if not self.has_unfinished_requests():
            return EngineCoreOutputs()
        if self.async_scheduling:
            outputs = self._step_overlapped()
        else:
            scheduler_output = self._schedule()
            try:
                runner_output = self.executor.execute_model(scheduler_output)
            except ExecutorDeadError:  # no step can run: the engine fails, not the requests
                raise
            except Exception:
                outputs = self._fail_step(scheduler_output)
            else:
                self.num_failed_steps_in_a_row = 0
                outputs = self.scheduler.update_from_output(runner_output)
        # The front end's timing metrics: when the tokens came, and the requests' state changes.
        outputs.timestamp = time.monotonic()
        if self.scheduler.events:
            outputs.events = self.scheduler.take_events()
        return outputs

    def _schedule(self) -> SchedulerOutput:
        scheduler_output = self.scheduler.schedule()
        self.num_steps += 1
        scheduled, requests = scheduler_output.num_scheduled_tokens, self.scheduler.requests
        residency = self.kv_block_residency
        self._last_step = SchedulerStats(
            num_scheduled_reqs=len(scheduled),
            num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
            # The scheduler has already advanced num_computed_tokens past this step's tokens.
            num_context_tokens=sum(requests[r].num_computed_tokens for r in scheduled),
            kv_block_evictions=residency.take_evictions() if residency is not None else [],
        )
        return scheduler_output

    def _step_overlapped(self) -> EngineCoreOutputs:
        """Asynchronous scheduling: schedule and launch step N+1 while step N may still run on
        the device, then take step N's results (the scheduler gave N+1 placeholders for the
        tokens N samples). No step stays in flight when nothing was scheduled, or when the host
        must see every token before planning the next step (`_sync_reason`): then the step runs
        synchronously, its predecessor collected before it is scheduled."""
        outputs: list[EngineCoreOutput] = []
        reason = self._sync_reason()
        if reason is not None:
            if reason not in self._logged_sync_reasons:
                self._logged_sync_reasons.add(reason)
                logger.info("Asynchronous scheduling off for some steps: %s", reason)
            outputs += self._collect_in_flight()
        scheduler_output = self._schedule()
        try:
            self.executor.launch_model(scheduler_output)
        except ExecutorDeadError:
            raise
        except Exception:
            outputs += self._collect_in_flight()  # the step before ran: its results stand
            outputs += self._fail_step(scheduler_output).outputs
            return EngineCoreOutputs(outputs=outputs)
        self.in_flight.append(scheduler_output)
        overlap = reason is None and scheduler_output.total_num_scheduled_tokens > 0
        outputs += self._collect_in_flight(keep=1 if overlap else 0)
        if self.in_flight and not self.scheduler.has_unfinished_requests():
            # Every request ended with the step just collected: what is left only ran on guesses.
            outputs += self._collect_in_flight()
        return EngineCoreOutputs(outputs=outputs)

    def _collect_in_flight(self, keep: int = 0) -> list[EngineCoreOutput]:
        """Collect launched steps, oldest first, until ``keep`` are left in flight. A step whose
        results cannot be collected fails, and so do those launched after it (their inputs came
        from it)."""
        outputs: list[EngineCoreOutput] = []
        while len(self.in_flight) > keep:
            scheduler_output = self.in_flight.popleft()
            try:
                runner_output = self.executor.collect_output()
            except ExecutorDeadError:
                raise
            except Exception:
                failed = [scheduler_output, *self.in_flight]
                self.in_flight.clear()
                for out in failed:
                    outputs += self._fail_step(out).outputs
                return outputs
            self.num_failed_steps_in_a_row = 0
            outputs += self.scheduler.update_from_output(runner_output).outputs
        return outputs

    def _sync_reason(self) -> str | None:
        """Why the next step cannot overlap the one in flight, or None."""
        scheduler = self.scheduler
        if scheduler.probe is not None or scheduler.quarantine:
            return "a failed step's requests run one at a time until the faulty one is found"
        if self._host_sync:
            for req_id in [r for r in self._host_sync if r not in scheduler.requests]:
                del self._host_sync[req_id]
            if self._host_sync:
                return next(iter(self._host_sync.values()))
        return None

    def _fail_step(self, out: SchedulerOutput) -> EngineCoreOutputs:
        """A step raised: the workers forget what it touched, and the scheduler fails the request
        that caused it (alone in its step) or sets the step's requests apart to find it. Steps
        failing again and again mean the engine itself is broken: then the error propagates."""
        self.num_failed_steps_in_a_row += 1
        if self.num_failed_steps_in_a_row > MAX_FAILED_STEPS_IN_A_ROW:
            raise RuntimeError(
                f"{self.num_failed_steps_in_a_row} engine steps failed in a row; the engine stops."
            )
        ids = sorted(out.num_scheduled_tokens)
        logger.exception("An engine step of %d request(s) failed: %s", len(ids), ", ".join(ids))
        self.executor.drop_requests(
            [*ids, *sorted(out.finished_req_ids), *sorted(out.preempted_req_ids)]
        )
        outputs = self.scheduler.fail_step(out)
        for failed in outputs.outputs:
            logger.error("Request %s failed: it makes the engine step raise", failed.request_id)
        return outputs

    def make_scheduler_stats(self) -> SchedulerStats:
        """The scheduler and KV cache as they stand now, and what the last step scheduled (sent
        with each step's outputs)."""
        sched = self.scheduler
        kv = self.kv_cache_manager
        prefix = kv.prefix_cache_stats
        return msgspec.structs.replace(
            self._last_step,
            num_running_reqs=len(sched.running),
            num_waiting_reqs=len(sched.waiting),
            num_deferred_reqs=len(sched.quarantine),
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.block_pool.num_blocks - 1,  # the null block is never handed out
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=sched.num_preemptions,
            num_steps=self.num_steps,
        )

    def get_state(self) -> dict[str, int | float]:
        """Scheduler and KV-cache state for admin endpoints; ``num_free_blocks ==
        num_total_blocks`` when no request holds a block."""
        stats = self.make_scheduler_stats()
        return {
            "num_running": stats.num_running_reqs,
            "num_waiting": stats.num_waiting_reqs + stats.num_deferred_reqs,
            "num_free_blocks": stats.num_free_blocks,
            "num_total_blocks": stats.num_total_blocks,
            "kv_cache_usage": stats.kv_cache_usage,
            "prefix_cache_hit_rate": self.kv_cache_manager.prefix_cache_stats.hit_rate,
        }

    def decode_weight_bytes(self) -> int:
        """Weight bytes one decode step reads (benchmarks' roofline: `ModelRunner`'s count)."""
        return self.executor.collective_rpc("decode_weight_bytes")[0]

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()
