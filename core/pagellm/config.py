"""Engine configuration: one resolved object (`EngineConfig`) passed to every layer, and pickled
to the engine-core process. `EngineArgs.create_engine_config` (engine/args.py) validates the user's
values and fills every field: no field is left for a later layer to pick."""

from __future__ import annotations

import os
from typing import Any, Literal, cast

import torch
from pydantic import BaseModel, ConfigDict, Field

from pagellm.multimodal.inputs import MultiModalSpec
from pagellm.sampling_params import DEFAULT_MAX_LOGPROBS

DTypeName = Literal["float32", "float16", "bfloat16"]
LoadFormat = Literal["auto", "safetensors", "gguf", "dummy"]
KVCacheDTypeName = Literal["auto", "fp8_e4m3"]
"""How the KV cache stores keys and values: auto (the model dtype) or fp8_e4m3."""

DTYPES: dict[DTypeName, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
KV_CACHE_DTYPES: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn}
"""Storage dtypes of the KV cache other than the model dtype (``auto``)."""


class ConfigError(ValueError):
    """An engine argument (a ``LLM`` keyword, a CLI flag) has a value the engine cannot use."""


def resolve_kv_cache_dtype(name: str) -> KVCacheDTypeName:
    """``--kv-cache-dtype``'s value as stored: auto, or fp8_e4m3 (``fp8`` is its alias)."""
    if name in ("auto", "fp8_e4m3"):
        return cast(KVCacheDTypeName, name)
    if name == "fp8":
        return "fp8_e4m3"
    if name == "fp8_e5m2":
        raise ConfigError(
            "kv_cache_dtype='fp8_e5m2' (--kv-cache-dtype) is not supported: no attention "
            "backend here stores e5m2 (one mantissa bit fewer than e4m3, for no gain with "
            "per-layer scales); use fp8 (e4m3) or auto."
        )
    raise ConfigError(
        f"kv_cache_dtype={name!r} (--kv-cache-dtype) is not one of auto, fp8, fp8_e4m3."
    )


class _Config(BaseModel):
    model_config = ConfigDict(
        arbitrary_types_allowed=True,
        extra="forbid",
        validate_assignment=True,
        protected_namespaces=(),
    )


Runner = Literal["generate", "pooling"]
"""What the engine does with a model: generate tokens, or pool each prompt into one vector."""
PoolingType = Literal["MEAN", "CLS", "LAST"]

TASKS: dict[Runner, frozenset[str]] = {
    "generate": frozenset({"generate"}),
    "pooling": frozenset({"embed"}),
}
"""The tasks a model served by each runner can do (what endpoint plugins' ``required_tasks``
are matched against)."""


class PoolerConfig(_Config):
    """How a pooling model turns a prompt's last hidden states into one vector."""

    pooling_type: PoolingType
    """MEAN: the mean over the prompt's tokens; CLS: its first token; LAST: its last token."""
    normalize: bool
    """L2-normalize the pooled vector (a request's ``normalize`` may say otherwise)."""


class ModelConfig(_Config):
    model: str
    """Local path: a Hugging Face model directory or a GGUF file."""
    tokenizer: str
    skip_tokenizer_init: bool
    """No tokenizer: prompts must be token ids and outputs carry no text."""
    gguf_file: str | None
    """Set when the weights come from a GGUF file (then tokenizer and config come from it too)."""
    dtype: DTypeName
    max_model_len: int
    seed: int
    architecture: str
    hf_config: Any = Field(repr=False)
    """The `transformers.PretrainedConfig` of the model."""
    io_processor: str | None = None
    """The registered name of the IO processor the front end builds for this model
    (`pagellm.io_processors`), or None: prompts and outputs as they are."""
    multimodal_specs: list[MultiModalSpec] = Field(default_factory=list)
    """What multimodal items the model takes (its class's ``multimodal_specs``); none for a
    text-only model."""
    runner: Runner = "generate"
    is_causal: bool = True
    """False for an encoder's bidirectional attention (every token sees the whole prompt)."""
    pooler: PoolerConfig | None = None
    """Set for the pooling runner."""
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    """Most logprobs one request may ask for (``--max-logprobs``); -1: the whole vocabulary."""
    trust_remote_code: bool = False
    """The model directory's own config/tokenizer code may run (``--trust-remote-code``)."""
    default_sampling: dict[str, Any] = Field(default_factory=dict)
    """The sampling defaults of requests that leave them unset (`SamplingParams` field names),
    from the model's generation config (``--generation-config``; `engine.generation_defaults`)."""

    @property
    def tasks(self) -> frozenset[str]:
        return TASKS[self.runner]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

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
        """Every layer's attention window (None: full attention), for backend, layers and KV spec."""
        cfg = self.text_config
        window = getattr(cfg, "sliding_window", None)
        kinds = set(getattr(cfg, "layer_types", None) or ["sliding_attention"])
        enabled = getattr(cfg, "use_sliding_window", True) is not False
        if not (window and enabled) or kinds == {"full_attention"}:
            return None
        if kinds != {"sliding_attention"}:
            raise NotImplementedError(
                "Models mixing sliding-window and full-attention layers are not supported yet."
            )
        return int(window)


class CacheConfig(_Config):
    block_size: int
    """Tokens per KV block (the user's, or the attention backend's default)."""
    enable_prefix_caching: bool
    kv_cache_memory: int | None
    """Bytes for the KV cache; None: the platform measures or picks them."""
    gpu_memory_utilization: float
    cache_dtype: KVCacheDTypeName = "auto"
    """auto: keys and values stored in the model dtype; fp8_e4m3: stored as float8 e4m3 with one
    scale per layer for keys and one for values (half the bytes, twice the tokens)."""

    def torch_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return KV_CACHE_DTYPES.get(self.cache_dtype, model_dtype)


class SchedulerConfig(_Config):
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    """A request's prefill chunk is capped at this many tokens per step (0: no cap)."""
    policy: str = "fcfs"
    """A registered scheduling policy (`pagellm.scheduler.policy`): waiting order, preemption victim."""
    async_scheduling: bool = False
    """Plan step N+1 while the device runs step N (`EngineCore`), resolved from the user's
    choice or the platform's `async_scheduling_default`."""
    stream_interval: int = Field(default=1, ge=1)
    """A streamed (DELTA) request's outputs, but its first and last, carry at least this many
    new tokens (the front end's `OutputProcessor`): fewer, larger chunks; 1: every step's."""


ExecutorBackend = Literal["uni", "mp", "ray"]
"""How the engine core reaches its workers: one in its own process (uni), one process per rank
(mp), or one Ray actor per rank (ray)."""


class ParallelConfig(_Config):
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    """Only 1 is built: the dimension exists so that the rank layout already has its place."""
    distributed_executor_backend: ExecutorBackend = "uni"

    @property
    def world_size(self) -> int:
        """Workers, one per rank."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


class DeviceConfig(_Config):
    device: str
    """The platform's device type ("cpu", "cuda", ...)."""


CudaGraphMode = Literal["none", "decode", "decode_and_piecewise"]
"""Which steps replay captured graphs: none; decode (decode-only batches, whole forward passes);
decode_and_piecewise (those, and every other step of at most the largest piecewise capture size,
as graphs of the forward pass's pieces between attention calls, attention run eagerly)."""


class CompilationConfig(_Config):
    enforce_eager: bool = False
    """Never capture CUDA graphs (the user's ``--enforce-eager``)."""
    cudagraph_mode: CudaGraphMode = "none"
    """The platform turns ``decode`` on where it records graphs; piecewise graphs are then added
    (``decode_and_piecewise``) unless the user asked for ``--cudagraph-mode decode``
    (`pagellm.engine.compilation`)."""
    cudagraph_capture_sizes: list[int] = Field(default_factory=list)
    """Decode batch sizes with a captured graph, ascending (a batch is padded up to the next)."""
    piecewise_capture_sizes: list[int] = Field(default_factory=list)
    """Token counts with captured piecewise graphs, ascending (a step is padded up to the next);
    empty unless ``cudagraph_mode`` is ``decode_and_piecewise``."""


class LoadConfig(_Config):
    load_format: LoadFormat = "auto"


class ObservabilityConfig(_Config):
    kv_cache_metrics: bool = False
    """Sample KV blocks' residency (lifetime, idle time before eviction, reuse gaps) for metrics."""
    kv_cache_metrics_sample: float = Field(default=0.01, gt=0.0, le=1.0)
    """The fraction of allocated blocks followed when ``kv_cache_metrics`` is on."""


class MultiModalConfig(_Config):
    """Limits on the media a request brings (read by the IO processors that decode it)."""

    allowed_local_media_path: str | None = None
    """A directory whose files requests may name as ``file:`` URLs (None: no local file)."""
    max_images_per_prompt: int = Field(default=4, ge=0)
    max_image_bytes: int = Field(default=20 << 20, ge=1)
    """The most bytes of one encoded image (a data URL's, decoded, or a file's)."""
    max_image_pixels: int = Field(default=4096 * 4096, ge=1)
    """The most pixels (width × height) of one decoded image."""

    @classmethod
    def from_args(cls, args: Any) -> MultiModalConfig:
        """The limits of the engine arguments (`EngineArgs`' fields of the same names), the
        media directory checked and made a real path."""
        directory = args.allowed_local_media_path
        if directory is not None:
            if not os.path.isdir(directory):
                raise ConfigError(
                    f"allowed_local_media_path={directory!r} (--allowed-local-media-path) is not "
                    "a directory."
                )
            directory = os.path.realpath(directory)
        return cls(
            allowed_local_media_path=directory,
            max_images_per_prompt=args.max_images_per_prompt,
            max_image_bytes=args.max_image_bytes,
            max_image_pixels=args.max_image_pixels,
        )


class EngineConfig(_Config):
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: DeviceConfig
    load: LoadConfig
    compilation: CompilationConfig
    attention_backend: str
    """The attention backend's registered name, chosen by the platform unless the user forced one."""
    quantization: str | None
    """The quantization method's registered name, or None for dense weights."""
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig)
    multimodal: MultiModalConfig = Field(default_factory=MultiModalConfig)
