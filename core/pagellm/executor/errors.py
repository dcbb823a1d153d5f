"""What an executor raises when a worker fails."""

from __future__ import annotations


class WorkerError(RuntimeError):
    """A worker's call or step raised; the worker lives on (the engine fails that step only)."""


class ExecutorDeadError(RuntimeError):
    """A worker is gone (killed, crashed, or its actor died): the executor cannot go on, and the
    engine fails rather than treat it as one failed step."""
