"""`EngineArgs`: the user-facing knobs (`LLM` keywords, CLI flags), turned into a complete
`EngineConfig` in one ordered place.

A field's type is its validation (pydantic: `Literal` for closed sets, bounds through `Field`) and
the docstring under it is its ``--help`` text; a bad value becomes one `ConfigError` naming the
flag, whether pydantic or a check that needs the model or the platform found it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, with_config

from pagellm.attention.selector import select_attention_backend
from pagellm.config import (
    CacheConfig,
    ConfigError,
    DeviceConfig,
    EngineConfig,
    ExecutorBackend,
    LoadConfig,
    LoadFormat,
    ModelConfig,
    MultiModalConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    resolve_kv_cache_dtype,
)
from pagellm.engine import compilation
from pagellm.engine.generation_defaults import resolve_default_sampling
from pagellm.engine.model_limits import resolve_dtype, resolve_max_model_len
from pagellm.engine.runners import pooler_config, resolve_runner
from pagellm.io_processors.selection import resolve_io_processor_name
from pagellm.model_loader.formats import get_model_format
from pagellm.model_loader.source import load_hf_config, resolve_model_source
from pagellm.models.registry import model_is_causal, model_runners, resolve_model_cls
from pagellm.multimodal.inputs import multimodal_specs
from pagellm.platforms import current_platform, current_platform_name
from pagellm.quantization.registry import quantization_methods
from pagellm.quantization.selection import resolve_quantization
from pagellm.sampling_params import DEFAULT_MAX_LOGPROBS
from pagellm.scheduler.policy import scheduling_policies

_DEFAULT_MAX_NUM_SEQS = 256
_DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192

PositiveInt = Annotated[int, Field(ge=1)]


def _json_object(text: str) -> dict[str, Any]:
    """A CLI value that is a JSON object."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


DTypeArg = Literal[
    "auto", "float32", "float16", "bfloat16", "float", "half", "fp32", "fp16", "bf16"
]


@with_config(ConfigDict(use_attribute_docstrings=True))
@dataclass
class EngineArgs:
    model: str
    """A Hugging Face model directory or a GGUF file (a local path)."""
    tokenizer: str | None = None
    """The tokenizer's directory or GGUF file (default: the model's)."""
    runner: Literal["auto", "generate", "pooling"] = "auto"
    """generate (text), or pooling (one vector per prompt: embeddings; no chunked prefill, no
    prefix caching); auto: the model's own (BertModel pools, decoders generate)."""
    task: Literal["auto", "generate", "embed"] = "auto"
    """vLLM's older name for the runner: embed is runner pooling, generate runner generate."""
    dtype: DTypeArg = "auto"
    """Weights and activations dtype; auto: the platform's choice for the checkpoint's dtype."""
    seed: int = 0
    """Seed for sampling without a per-request seed, and for dummy weights."""
    max_model_len: PositiveInt | None = None
    """Most tokens of one request, prompt and output (default: max_position_embeddings)."""
    block_size: PositiveInt | None = None
    """Tokens per KV cache block (default: the attention backend's)."""
    max_num_seqs: PositiveInt | None = None
    """Most requests running in one step (default: 256)."""
    max_num_batched_tokens: PositiveInt | None = None
    """Most tokens computed in one step (default: 8192; unchunked, at least max_model_len)."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of equal prompt prefixes across requests."""
    enable_chunked_prefill: bool = True
    """Split long prompts over several steps, batched with the decodes."""
    long_prefill_token_threshold: Annotated[int, Field(ge=0)] = 0
    """Most prefill tokens of one request in one step (0: no cap)."""
    scheduling_policy: str = "fcfs"
    """Order of the waiting queue: fcfs, or priority (lower value first, then arrival)."""
    load_format: LoadFormat = "auto"
    """auto (by the model's files), safetensors, gguf, or dummy (random weights)."""
    kv_cache_memory: PositiveInt | None = None
    """Bytes for the KV cache (default: the platform's; a share of RAM on CPU, measured on GPU)."""
    kv_cache_dtype: str = "auto"
    """KV cache storage: auto (the model dtype), or fp8 / fp8_e4m3 (float8 e4m3, per-layer
    k/v scales from the checkpoint, else 1.0): half the bytes a token, twice the tokens."""
    gpu_memory_utilization: Annotated[float, Field(gt=0.0, le=1.0)] = 0.9
    """Fraction of the GPU's memory the engine may take (weights, activations, KV cache)."""
    attention_backend: str | None = None
    """An attention backend by registered name (default: the platform's best that fits)."""
    quantization: str | None = None
    """A quantization method by registered name (default: the checkpoint's own, read from its
    config.json's quantization_config, else dense weights)."""
    device: str | None = None
    """The platform (name or device type): the CLI selects it, LLM checks it is the current one."""
    tensor_parallel_size: PositiveInt = 1
    """Ranks (GPUs; processes on the CPU) the model's layers are sharded over."""
    pipeline_parallel_size: PositiveInt = 1
    """Pipeline stages (only 1 is supported yet)."""
    distributed_executor_backend: ExecutorBackend | None = None
    """How the workers run: uni (one, in the engine core's process), mp (one process per rank),
    ray (one Ray actor per rank); default: uni for one rank, else mp."""
    enforce_eager: bool = False
    """Never capture CUDA graphs: every step runs eagerly."""
    cudagraph_mode: compilation.RequestedCudaGraphMode = "auto"
    """CUDA graphs: auto (where the platform records graphs: decode graphs, and piecewise
    graphs for the other steps up to the largest --piecewise-capture-sizes, as graphs between
    eager attention calls), none (as --enforce-eager), decode (decode graphs only), or
    decode_and_piecewise (as auto, refused where the platform records no graphs)."""
    piecewise_capture_sizes: list[PositiveInt] | None = None
    """Token counts with piecewise graphs (default: 16 32 64 128 256 384 512 768 1024 1536 2048
    3072 4096 6144 8192 12288 16384 up to max_num_batched_tokens, and that budget); a step is
    padded up to the next."""
    async_scheduling: bool | None = None
    """Schedule the next step while the device runs the current one (same tokens, less idle
    device time); default: the platform's choice (on for CUDA, off on the CPU)."""
    stream_interval: PositiveInt = 1
    """Streamed outputs carry at least this many new tokens, but the first and the last (fewer,
    larger chunks, less front-end work per token; 1: a chunk per step)."""
    io_processor: str | None = None
    """An IO processor by registered name (pagellm.io_processor_plugins), in the front end
    (default: config.json's io_processor_plugin, else its architecture's, else none)."""
    allowed_local_media_path: str | None = None
    """A directory whose files requests may name as file: URLs for their images (default: none)."""
    max_images_per_prompt: Annotated[int, Field(ge=0)] = 4
    """Most images in one prompt (one chat request); more are refused (HTTP 400)."""
    max_image_bytes: PositiveInt = 20 << 20
    """Most bytes of one encoded image (a data URL's, decoded, or a file's)."""
    max_image_pixels: PositiveInt = 4096 * 4096
    """Most pixels (width × height) of one image, checked before it is decoded."""
    skip_tokenizer_init: bool = False
    """No tokenizer: prompts must be token ids and outputs carry no text."""
    trust_remote_code: bool = False
    """Let the model directory's own config and tokenizer code (auto_map) run, as in vLLM."""
    max_logprobs: Annotated[int, Field(ge=-1)] = DEFAULT_MAX_LOGPROBS
    """Most logprobs (and prompt_logprobs) a request may ask for, as in vLLM; -1: the vocabulary."""
    generation_config: str = "auto"
    """Where requests' default sampling values come from (as in vLLM): auto, the model's
    generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens);
    vllm, none (the API's own defaults); or a directory holding a generation_config.json."""
    override_generation_config: dict[str, Any] | None = None
    """Sampling defaults set over the generation config's, as JSON: '{"temperature": 0.5}'."""
    multiprocess_engine: bool = False
    """LLM: run the engine core in a background process (the API server always does)."""
    kv_cache_metrics: bool = False
    """Sample KV cache blocks for the residency metrics (lifetime, idle before eviction, reuse)."""
    kv_cache_metrics_sample: Annotated[float, Field(gt=0.0, le=1.0)] = 0.01
    """The fraction of allocated KV cache blocks --kv-cache-metrics follows."""

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One ``--flag`` per field but ``model`` (``--no-enable-prefix-caching`` style for
        booleans, choices for closed sets), its help the field's docstring."""
        docs = _VALIDATOR.json_schema()["properties"]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name == "model":
                continue
            hint = hints[f.name]
            if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None: takes an X
                hint = next(a for a in typing.get_args(hint) if a is not type(None))
            options: dict[str, Any] = {"default": f.default, "help": docs[f.name]["description"]}
            if hint is bool:
                options["action"] = argparse.BooleanOptionalAction
            elif typing.get_origin(hint) is Literal:
                options["choices"] = typing.get_args(hint)
            elif typing.get_origin(hint) is list:  # --flag A B C
                options.update(nargs="+", type=typing.get_args(hint)[0])
            elif typing.get_origin(hint) is dict:  # --flag '{"key": value}'
                options["type"] = _json_object
            else:
                options["type"] = hint
            parser.add_argument("--" + f.name.replace("_", "-"), **options)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def create_engine_config(self) -> EngineConfig:
        """Validate every field, then fill the config in dependency order: model, dtype, lengths,
        budgets, attention backend, the platform's last look."""
        try:
            args = _VALIDATOR.validate_python(vars(self))
        except ValidationError as exc:
            problems = []
            for error in exc.errors():
                name = str(error["loc"][0])
                flag = "--" + name.replace("_", "-")
                problems.append(f"{name}={error['input']!r} ({flag}): {error['msg']}")
            raise ConfigError("; ".join(problems) + ".") from None
        return args._resolve()

    def _resolve(self) -> EngineConfig:
        platform = current_platform
        if self.device not in (None, current_platform_name(), platform.device_type):
            raise ConfigError(
                f"device={self.device!r} but this process runs on platform {platform.name!r}; "
                "choose the platform before first use with PAGELLM_PLATFORM (the CLI's --device does)."
            )
        parallel = self._resolve_parallel(platform)
        source = resolve_model_source(self.model, field="model")
        tokenizer = self.tokenizer or self.model
        if not self.skip_tokenizer_init:
            resolve_model_source(tokenizer, field="tokenizer")
        hf_config = load_hf_config(source, self.trust_remote_code)
        architectures = list(getattr(hf_config, "architectures", None) or [])
        architecture, model_cls = resolve_model_cls(architectures)
        runner = resolve_runner(self, architecture, model_runners(model_cls))
        io_processor = resolve_io_processor_name(self.io_processor, hf_config, model_cls)

        model_cfg = ModelConfig(
            model=self.model,
            tokenizer=tokenizer,
            gguf_file=source.gguf_file,
            dtype=resolve_dtype(self.dtype, hf_config, platform),
            max_model_len=1,  # set below, once the config's own limit is known
            seed=self.seed,
            skip_tokenizer_init=self.skip_tokenizer_init,
            architecture=architecture,
            hf_config=hf_config,
            io_processor=io_processor,
            multimodal_specs=multimodal_specs(model_cls, hf_config),
            runner=runner,
            is_causal=model_is_causal(model_cls),
            pooler=pooler_config(runner, source, model_cls),
            max_logprobs=self.max_logprobs,
            trust_remote_code=self.trust_remote_code,
        )
        model_cfg.max_model_len = resolve_max_model_len(self.max_model_len, model_cfg)
        if runner == "generate":
            model_cfg.default_sampling = resolve_default_sampling(
                self.generation_config, self.override_generation_config, source.hf_directory()
            )

        pooling = runner == "pooling"
        chunked = self.enable_chunked_prefill and not pooling  # pooling: each prompt whole
        max_num_batched_tokens = self.max_num_batched_tokens or (
            _DEFAULT_MAX_NUM_BATCHED_TOKENS
            if chunked
            else max(_DEFAULT_MAX_NUM_BATCHED_TOKENS, model_cfg.max_model_len)
        )
        if not chunked and max_num_batched_tokens < model_cfg.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens={max_num_batched_tokens} is smaller than max_model_len="
                f"{model_cfg.max_model_len} with chunked prefill off, so a long prompt could never be "
                "scheduled; raise max_num_batched_tokens, lower max_model_len"
                + ("." if pooling else " or enable chunked prefill.")
            )
        quantization = self._resolve_quantization(model_cfg, platform.device_type)
        scheduling_policies.get(self.scheduling_policy)  # an unknown name lists the installed ones
        kv_cache_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype)
        backend = select_attention_backend(
            requested=self.attention_backend,
            ranking=platform.attention_backend_ranking(),
            device_type=platform.device_type,
            head_size=model_cfg.head_size,
            dtype=model_cfg.torch_dtype,
            block_size=self.block_size,
            sliding_window=model_cfg.sliding_window,
            kv_cache_dtype=kv_cache_dtype,
            causal=model_cfg.is_causal,
        )
        config = EngineConfig(
            model=model_cfg,
            cache=CacheConfig(
                block_size=self.block_size or backend.default_block_size_for(kv_cache_dtype),
                enable_prefix_caching=self.enable_prefix_caching and not pooling,
                kv_cache_memory=self.kv_cache_memory,
                gpu_memory_utilization=self.gpu_memory_utilization,
                cache_dtype=kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs or _DEFAULT_MAX_NUM_SEQS,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=model_cfg.max_model_len,
                enable_chunked_prefill=chunked,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                policy=self.scheduling_policy,
                async_scheduling=platform.async_scheduling_default
                if self.async_scheduling is None
                else self.async_scheduling,
                stream_interval=self.stream_interval,
            ),
            parallel=parallel,
            device=DeviceConfig(device=platform.device_type),
            load=LoadConfig(load_format=self.load_format),
            compilation=compilation.compilation_config(self, pooling),
            attention_backend=backend.name,
            quantization=quantization,
            observability=ObservabilityConfig(
                kv_cache_metrics=self.kv_cache_metrics,
                kv_cache_metrics_sample=self.kv_cache_metrics_sample,
            ),
            multimodal=MultiModalConfig.from_args(self),
        )
        platform.check_and_update_config(config)
        compilation.apply_cudagraph_mode(config, self, platform)
        return config

    def _resolve_parallel(self, platform: Any) -> ParallelConfig:
        if self.pipeline_parallel_size != 1:
            raise ConfigError(
                f"pipeline_parallel_size={self.pipeline_parallel_size} (--pipeline-parallel-size): "
                "only 1 is supported; shard a large model with --tensor-parallel-size instead."
            )
        world_size = self.tensor_parallel_size * self.pipeline_parallel_size
        backend = self.distributed_executor_backend or ("uni" if world_size == 1 else "mp")
        if backend == "uni" and world_size > 1:
            raise ConfigError(
                f"distributed_executor_backend='uni' (--distributed-executor-backend) runs one "
                f"worker; {world_size} ranks need mp or ray."
            )
        count = platform.device_count()
        if count is not None and world_size > count and backend != "ray":
            raise ConfigError(
                f"tensor_parallel_size={self.tensor_parallel_size} needs {world_size} devices; "
                f"{count} are visible on {platform.name}. Lower --tensor-parallel-size, or use "
                "--distributed-executor-backend ray to place ranks on several machines."
            )
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            distributed_executor_backend=backend,
        )

    def _resolve_quantization(self, model_cfg: ModelConfig, device_type: str) -> str | None:
        """The method asked for, or the checkpoint's own; refused here when it cannot run."""
        checkpoint_quant = getattr(model_cfg.hf_config, "quantization_config", None)
        try:
            name = resolve_quantization(self.quantization, dict(checkpoint_quant or {}))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if name is None and model_cfg.gguf_file and self.load_format != "dummy":
            # A GGUF file's weights are quantized without a quantization_config: its reader
            # names the method that keeps them so on this platform, if any.
            name = get_model_format("gguf").default_quantization(
                model_cfg.gguf_file, device_type, model_cfg.torch_dtype
            )
        if name is None:
            return None
        quant_cls = quantization_methods.get(name)
        model_format = (
            "dummy"
            if self.load_format == "dummy"
            else ("gguf" if model_cfg.gguf_file else "safetensors")
        )
        if quant_cls.reads_model_format not in (None, model_format):
            raise ConfigError(
                f"quantization={name!r} keeps the quantized tensors of "
                f"{quant_cls.reads_model_format} files; this model's weights are {model_format}."
            )
        try:  # the checkpoint's scheme is judged here, not first in the engine-core process
            quant_cls.from_config(dict(checkpoint_quant or {}))
        except ValueError as exc:
            raise ConfigError(f"quantization={name!r}: {exc}") from None
        if model_cfg.torch_dtype not in quant_cls.supported_dtypes:
            supported = ", ".join(str(d).removeprefix("torch.") for d in quant_cls.supported_dtypes)
            raise ConfigError(
                f"quantization={name!r} does not support dtype {model_cfg.dtype} "
                f"(supports {supported}); pass --dtype with one of those."
            )
        refusal = quant_cls.platform_refusal(device_type, model_cfg.torch_dtype)
        if refusal is not None:
            raise ConfigError(f"quantization={name!r} cannot run here: {refusal}")
        tp = self.tensor_parallel_size
        refusal = (
            quant_cls.tensor_parallel_refusal(tp, dict(checkpoint_quant or {})) if tp > 1 else None
        )
        if refusal is not None:  # judged here too, not first in every worker process
            raise ConfigError(refusal)
        return name


_VALIDATOR = TypeAdapter(EngineArgs)
