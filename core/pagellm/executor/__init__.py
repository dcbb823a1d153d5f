from pagellm.executor.abstract import Executor
from pagellm.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "UniProcExecutor"]
