"""Which `Executor` class runs a config's workers (``parallel.distributed_executor_backend``)."""

from __future__ import annotations

from pagellm.config import ParallelConfig
from pagellm.executor.abstract import Executor


def executor_class(parallel: ParallelConfig) -> type[Executor]:
    # Imported on demand: the multi-process executors pull in ZMQ or Ray, and the engine core.
    backend = parallel.distributed_executor_backend
    if backend == "mp":
        from pagellm.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor
    if backend == "ray":
        from pagellm.executor.ray_executor import RayExecutor

        return RayExecutor
    from pagellm.executor.uniproc import UniProcExecutor

    return UniProcExecutor
