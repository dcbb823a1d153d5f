"""One rank of a multi-worker executor: it joins the process groups, builds its `Worker`, and
answers the driver's messages (`executor.wire`). The worker processes of `MultiprocExecutor` and
the actors of `RayExecutor` both run one."""

from __future__ import annotations

import logging
import traceback

from pagellm.config import EngineConfig
from pagellm.distributed import destroy_distributed, init_distributed
from pagellm.executor import wire
from pagellm.platforms import current_platform
from pagellm.worker.worker import Worker

logger = logging.getLogger(__name__)

OUTPUT_RANK = 0
"""The rank whose step outputs the driver takes (every rank samples the same tokens)."""


class WorkerHost:
    def __init__(self, config: EngineConfig, rank: int, local_rank: int, init_method: str) -> None:
        parallel = config.parallel
        init_distributed(
            world_size=parallel.world_size,
            rank=rank,
            tensor_parallel_size=parallel.tensor_parallel_size,
            init_method=init_method,
            backend=current_platform.dist_backend,
            custom_all_reduce=current_platform.custom_all_reduce,
        )
        self.rank = rank
        self.worker = Worker(config, local_rank=local_rank)
        self.worker.load_model()

    def handle(self, msg: wire.DriverMsg) -> wire.WorkerMsg | None:
        """This rank's answer to ``msg``, or None: only the output rank answers a step (and any
        rank whose step raised)."""
        worker, answers = self.worker, self.rank == OUTPUT_RANK
        if isinstance(msg, wire.Stop):
            return None
        try:
            if isinstance(msg, wire.ExecuteModel):
                output = worker.execute_model(msg.scheduler_output)
                return wire.StepDone(msg.seq, output) if answers else None
            if isinstance(msg, wire.LaunchModel):
                worker.launch_model(msg.scheduler_output)
                return wire.StepDone(msg.seq) if answers else None
            if isinstance(msg, wire.CollectOutput):
                output = worker.collect_output()
                return wire.StepDone(msg.seq, output) if answers else None
            return wire.CallResult(msg.seq, self.rank, self._call(msg))
        except Exception as exc:
            logger.exception("Worker rank %d: %s raised", self.rank, type(msg).__name__)
            return wire.Failure(
                msg.seq, self.rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()
            )

    def _call(self, call: wire.Call) -> object:
        if call.method.startswith("_") or not callable(getattr(Worker, call.method, None)):
            raise AttributeError(f"Worker has no public method {call.method!r}")
        hints = wire.method_hints(Worker, call.method)
        params = [h for name, h in hints.items() if name != "return"]
        args = [wire.convert(a, t) for a, t in zip(call.args, params, strict=False)]
        return getattr(self.worker, call.method)(*args)

    def close(self) -> None:
        destroy_distributed()
