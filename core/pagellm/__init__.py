"""pagellm: a high-throughput, plugin-first LLM inference and serving engine."""

from pagellm.engine.args import EngineArgs
from pagellm.entrypoints.llm import LLM
from pagellm.outputs import CompletionOutput, Logprob, RequestOutput
from pagellm.sampling_params import SamplingParams
from pagellm.version import __version__

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]
