"""Workers as Ray actors, one per rank, placed by a placement group (one bundle per rank), so an
engine that outgrows one machine runs on an existing Ray cluster.

The driver connects to the cluster named by ``RAY_ADDRESS`` (``ray start`` sets it up), or else
starts a local Ray instance with one CPU per rank. The process groups meet at a TCP port on the
driver's node address; every actor runs a `WorkerHost` and is sent the same msgspec frames as the
workers of `MultiprocExecutor` (Ray carries them as bytes). Every rank's reply is awaited (an
unread future would hide its error); only the output rank's carries the step's output. A dead
actor raises `ExecutorDeadError` at the next call (Ray gives no exit code).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from pagellm.config import ConfigError, EngineConfig
from pagellm.executor import wire
from pagellm.executor.abstract import Executor
from pagellm.executor.errors import ExecutorDeadError, WorkerError
from pagellm.executor.multiproc import free_port
from pagellm.executor.worker_host import OUTPUT_RANK, WorkerHost
from pagellm.platforms import current_platform
from pagellm.scheduler.output import ModelRunnerOutput, SchedulerOutput
from pagellm.worker.worker import Worker

try:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError:  # an optional dependency: pip install 'pagellm[ray]'
    ray = None  # type: ignore[assignment]


class RankActor:
    """One rank inside a Ray actor (`ray.remote` wraps it when the executor starts)."""

    def __init__(self, config: EngineConfig, rank: int, init_method: str) -> None:
        # Ray gives each actor its own devices (CUDA_VISIBLE_DEVICES): its first is its rank's.
        self.host = WorkerHost(config, rank, local_rank=0, init_method=init_method)

    def handle(self, frame: bytes) -> bytes | None:
        reply = self.host.handle(wire.driver_decoder.decode(frame))
        return None if reply is None else wire.encoder.encode(reply)


class RayExecutor(Executor):
    def _init_executor(self) -> None:
        if ray is None:
            raise ConfigError(
                "distributed_executor_backend='ray' needs Ray: pip install 'pagellm[ray]'."
            )
        world_size = self.config.parallel.world_size
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            if os.environ.get("RAY_ADDRESS"):
                ray.init()
            else:
                ray.init(num_cpus=world_size, include_dashboard=False, log_to_driver=False)
        device_type = current_platform.device_type
        bundle = {"GPU": 1} if device_type != "cpu" else {"CPU": 1}
        self._group = placement_group([bundle] * world_size, strategy="PACK")
        ray.get(self._group.ready())
        init_method = f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"
        remote = ray.remote(num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0))(RankActor)
        self.actors: list[Any] = [
            remote.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._group, placement_group_bundle_index=rank
                )
            ).remote(self.config, rank, init_method)
            for rank in range(world_size)
        ]
        self._seq = 0
        # The first call waits for every actor's start-up (model loaded) and reports its errors.
        self.collective_rpc("get_kv_cache_spec")

    def _broadcast(self, msg: wire.DriverMsg) -> list[wire.WorkerMsg | None]:
        """Send ``msg`` to every rank; their replies in rank order (raises the first failure)."""
        frame = wire.encoder.encode(msg)
        refs = [actor.handle.remote(frame) for actor in self.actors]
        replies: list[wire.WorkerMsg | None] = []
        for rank, ref in enumerate(refs):
            try:
                reply = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                raise ExecutorDeadError(f"Worker rank {rank} (Ray actor) died: {exc}") from None
            replies.append(None if reply is None else wire.worker_decoder.decode(reply))
        for reply in replies:
            if isinstance(reply, wire.Failure):
                raise WorkerError(f"Worker rank {reply.rank}: {reply.message}\n{reply.traceback}")
        return replies

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _output(self, msg: wire.DriverMsg) -> Any:
        reply = self._broadcast(msg)[OUTPUT_RANK]
        return reply.output if isinstance(reply, wire.StepDone) else None

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._output(wire.ExecuteModel(self._next_seq(), scheduler_output))

    def launch_model(self, scheduler_output: SchedulerOutput) -> None:
        self._broadcast(wire.LaunchModel(self._next_seq(), scheduler_output))

    def collect_output(self) -> ModelRunnerOutput:
        return self._output(wire.CollectOutput(self._next_seq()))

    def collective_rpc(
        self, method: str | Callable[..., Any], args: tuple[Any, ...] = ()
    ) -> list[Any]:
        """Only `Worker` method names are sent, as in `MultiprocExecutor`."""
        if not isinstance(method, str):
            raise TypeError("RayExecutor.collective_rpc takes a Worker method name.")
        replies = self._broadcast(wire.Call(self._next_seq(), method, list(args)))
        returns = wire.method_hints(Worker, method).get("return")
        return [
            wire.convert(r.result if isinstance(r, wire.CallResult) else None, returns)
            for r in replies
        ]

    def shutdown(self) -> None:
        for actor in getattr(self, "actors", []):
            ray.kill(actor)
        self.actors = []
        if getattr(self, "_group", None) is not None:
            remove_placement_group(self._group)
            self._group = None
        if getattr(self, "_started_ray", False):
            ray.shutdown()
            self._started_ray = False
