"""One worker, in the engine core's own process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagellm.executor.abstract import Executor
from pagellm.worker.worker import Worker


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.worker = Worker(self.config)
        self.worker.load_model()

    def collective_rpc(
        self, method: str | Callable[..., Any], args: tuple[Any, ...] = ()
    ) -> list[Any]:
        if isinstance(method, str):
            return [getattr(self.worker, method)(*args)]
        return [method(self.worker, *args)]
