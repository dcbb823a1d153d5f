"""The executor interface: how the engine core reaches its workers (one, or one per GPU rank)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from pagellm.config import EngineConfig
from pagellm.kv_cache.spec import KVCacheSpec
from pagellm.scheduler.output import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._failure_callbacks: list[Callable[[str], None]] = []
        self._init_executor()

    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(message)`` from another thread when a worker dies while no call
        waits on it (executors whose workers run elsewhere; a call in progress raises instead)."""
        self._failure_callbacks.append(callback)

    def _report_failure(self, message: str) -> None:
        for callback in self._failure_callbacks:
            callback(message)

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers and load the model on each."""

    @abstractmethod
    def collective_rpc(
        self, method: str | Callable[..., Any], args: tuple[Any, ...] = ()
    ) -> list[Any]:
        """Call ``method`` on every worker (a method name, or a function taking the worker first);
        returns each worker's result, in rank order."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        # Every rank computes the same sampled tokens; rank 0's answer is the one returned.
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def launch_model(self, scheduler_output: SchedulerOutput) -> None:
        """Queue a step on every worker without waiting for its results (`collect_output`)."""
        self.collective_rpc("launch_model", (scheduler_output,))

    def collect_output(self) -> ModelRunnerOutput:
        """The results of the oldest step launched and not collected yet."""
        return self.collective_rpc("collect_output")[0]

    def drop_requests(self, req_ids: list[str]) -> None:
        """Make every worker forget these requests (after a step that raised)."""
        self.collective_rpc("drop_requests", (req_ids,))

    def get_kv_cache_spec(self) -> KVCacheSpec:
        return self.collective_rpc("get_kv_cache_spec")[0]

    def determine_available_memory(self) -> int:
        """The smallest memory any worker can give the KV cache."""
        return min(self.collective_rpc("determine_available_memory"))

    def initialize_cache(self, num_blocks: int) -> dict[str, float]:
        """Allocate the KV caches and capture the graphs; returns the seconds rank 0 spent
        capturing each kind of graph (every rank captures the same ones)."""
        return self.collective_rpc("initialize_cache", (num_blocks,))[0]

    def shutdown(self) -> None:  # noqa: B027 (optional hook: executors without resources keep it)
        """Release the workers."""
