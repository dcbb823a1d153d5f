"""Engine configuration: one validated object (`EngineConfig`) passed to every layer.

`EngineArgs.create_engine_config` (engine/args.py) is the one place that builds and cross-checks it.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
DTYPE_ALIASES = {
    "float": "float32",
    "half": "float16",
    "fp32": "float32",
    "fp16": "float16",
    "bf16": "bfloat16",
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype {dtype} is not supported; use one of {sorted(_DTYPES)}")


class _Config(BaseModel):
    model_config = ConfigDict(
        arbitrary_types_allowed=True,
        extra="forbid",
        validate_assignment=True,
        protected_namespaces=(),
    )


class ModelConfig(_Config):
    model: str
    """Local path: a Hugging Face model directory or a GGUF file."""
    tokenizer: str
    skip_tokenizer_init: bool = False
    """No tokenizer: prompts must be token ids and outputs carry no text."""
    gguf_file: str | None = None
    """Set when the weights come from a GGUF file (then tokenizer and config come from it too)."""
    dtype: str = "float32"
    max_model_len: int
    seed: int = 0
    architecture: str
    hf_config: Any = Field(repr=False)
    """The `transformers.PretrainedConfig` of the model."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def text_config(self) -> Any:
        return getattr(self.hf_config, "text_config", None) or self.hf_config

    @property
    def vocab_size(self) -> int:
        return int(self.text_config.vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)

    @property
    def num_attention_heads(self) -> int:
        return int(self.text_config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        cfg = self.text_config
        return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)

    @property
    def head_size(self) -> int:
        cfg = self.text_config
        head_dim = getattr(cfg, "head_dim", None)
        return int(head_dim or cfg.hidden_size // cfg.num_attention_heads)

    @property
    def sliding_window(self) -> int | None:
        cfg = self.text_config
        if getattr(cfg, "use_sliding_window", True) is False:
            return None
        window = getattr(cfg, "sliding_window", None)
        return int(window) if window else None


class CacheConfig(_Config):
    block_size: int | None = None
    """Tokens per KV block; None lets the platform pick what the attention backend supports."""
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: Literal["sha256"] = "sha256"
    kv_cache_memory: int | None = None
    """Bytes for the KV cache (CPU); None: a platform default."""
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    num_blocks: int | None = None
    """Filled in once the executor has measured the memory available for the KV cache."""


class SchedulerConfig(_Config):
    max_num_seqs: int = Field(ge=1)
    max_num_batched_tokens: int = Field(ge=1)
    max_model_len: int = Field(ge=1)
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = Field(default=0, ge=0)
    """A request's prefill chunk is capped at this many tokens per step (0: no cap)."""
    policy: str = "fcfs"
    """A registered scheduling policy (`pagellm.scheduler.policy`): waiting order, preemption victim."""


class ParallelConfig(_Config):
    tensor_parallel_size: int = Field(default=1, ge=1)
    pipeline_parallel_size: int = Field(default=1, ge=1)
    distributed_executor_backend: Literal["uni"] = "uni"


class DeviceConfig(_Config):
    device: str = "cpu"
    """The platform's device type ("cpu", "cuda", ...)."""


class CompilationConfig(_Config):
    enforce_eager: bool = False
    """Never capture CUDA graphs (the user's ``--enforce-eager``)."""
    cudagraph_mode: Literal["none", "decode"] = "none"
    """``decode``: decode-only batches replay captured graphs. Set by the platform in
    ``check_and_update_config`` (and kept ``none`` when ``enforce_eager``)."""
    cudagraph_capture_sizes: list[int] = Field(default_factory=list)
    """Batch sizes (requests = tokens in a decode-only batch) with a captured graph, ascending;
    a batch is padded up to the next one. Filled in by the platform."""


class LoadConfig(_Config):
    load_format: Literal["auto", "safetensors", "gguf", "dummy"] = "auto"


class EngineConfig(_Config):
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: DeviceConfig
    load: LoadConfig
    compilation: CompilationConfig = Field(default_factory=CompilationConfig)
    attention_backend: str | None = None
    """The attention backend's registered name, chosen by the platform unless the user forced one."""
    quantization: str | None = None
    """The quantization method's registered name, or None for dense weights."""
