"""`EngineArgs`: the user-facing knobs (LLM kwargs and CLI flags), turned into a validated
`EngineConfig` in one ordered place."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from pagellm.attention.selector import select_attention_backend
from pagellm.config import (
    DTYPE_ALIASES,
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    EngineConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    dtype_name,
)
from pagellm.model_loader.source import load_hf_config, resolve_model_source
from pagellm.models.registry import resolve_model_cls
from pagellm.platforms import current_platform, current_platform_name
from pagellm.quantization.registry import get_quantization_config_cls
from pagellm.scheduler.policy import scheduling_policies

_DEFAULT_MAX_NUM_SEQS = 256
_DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


@dataclass
class EngineArgs:
    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    load_format: str = "auto"
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    attention_backend: str | None = None
    quantization: str | None = None
    device: str | None = None
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    skip_tokenizer_init: bool = False
    multiprocess_engine: bool = False
    """`LLM` / `LLMEngine`: run the engine core in a background process (`AsyncLLM` always does)."""

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One ``--flag`` per field (``--no-enable-prefix-caching`` style for booleans)."""
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            if f.name == "model":
                continue
            if f.type in ("bool", bool):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
            elif f.type in ("int", "int | None"):
                parser.add_argument(flag, type=int, default=f.default)
            elif f.type == "float":
                parser.add_argument(flag, type=float, default=f.default)
            else:
                parser.add_argument(flag, type=str, default=f.default)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def create_engine_config(self) -> EngineConfig:
        platform = current_platform
        if self.device is not None and self.device not in (
            current_platform_name(),
            platform.device_type,
        ):
            raise ValueError(
                f"device={self.device!r} but this process runs on platform {platform.name!r}; "
                "choose the platform before first use with PAGELLM_PLATFORM (the CLI's --device does)."
            )
        source = resolve_model_source(self.model, field="model")
        tokenizer = self.tokenizer or self.model
        if not self.skip_tokenizer_init:
            resolve_model_source(tokenizer, field="tokenizer")
        hf_config = load_hf_config(source)
        architectures = list(getattr(hf_config, "architectures", None) or [])
        architecture, _ = resolve_model_cls(architectures)

        model_cfg = ModelConfig(
            model=self.model,
            tokenizer=tokenizer,
            gguf_file=source.gguf_file,
            dtype=self._resolve_dtype(hf_config, platform),
            max_model_len=1,  # set below, once the config's own limit is known
            seed=self.seed,
            skip_tokenizer_init=self.skip_tokenizer_init,
            architecture=architecture,
            hf_config=hf_config,
        )
        model_cfg.max_model_len = self._resolve_max_model_len(model_cfg)

        chunked = self.enable_chunked_prefill
        max_num_batched_tokens = self.max_num_batched_tokens or (
            _DEFAULT_MAX_NUM_BATCHED_TOKENS
            if chunked
            else max(_DEFAULT_MAX_NUM_BATCHED_TOKENS, model_cfg.max_model_len)
        )
        if not chunked and max_num_batched_tokens < model_cfg.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} is smaller than max_model_len="
                f"{model_cfg.max_model_len} with chunked prefill off, so a long prompt could never be "
                "scheduled; raise max_num_batched_tokens, lower max_model_len or enable chunked prefill."
            )
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", max_num_batched_tokens)
        _positive("block_size", self.block_size)
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(
                f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}."
            )
        if self.tensor_parallel_size != 1:
            raise NotImplementedError("tensor_parallel_size > 1 is not supported yet.")
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(
                f"load_format={self.load_format!r} is not supported; use auto, safetensors, gguf or dummy."
            )

        if self.quantization is not None:
            quant_cls = get_quantization_config_cls(self.quantization)
            if model_cfg.torch_dtype not in quant_cls.supported_dtypes:
                raise ValueError(
                    f"quantization={self.quantization!r} does not support dtype {model_cfg.dtype}."
                )
        scheduling_policies.get(self.scheduling_policy)  # an unknown name lists the installed ones
        backend = select_attention_backend(
            requested=self.attention_backend,
            ranking=platform.attention_backend_ranking(),
            device_type=platform.device_type,
            head_size=model_cfg.head_size,
            dtype=model_cfg.torch_dtype,
            block_size=self.block_size,
            sliding_window=model_cfg.sliding_window,
        )
        config = EngineConfig(
            model=model_cfg,
            cache=CacheConfig(
                block_size=self.block_size or backend.default_block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_memory=self.kv_cache_memory,
                gpu_memory_utilization=self.gpu_memory_utilization,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs or _DEFAULT_MAX_NUM_SEQS,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=model_cfg.max_model_len,
                enable_chunked_prefill=chunked,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                policy=self.scheduling_policy,
            ),
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size),
            device=DeviceConfig(device=platform.device_type),
            load=LoadConfig(load_format=self.load_format),  # type: ignore[arg-type]
            compilation=CompilationConfig(enforce_eager=self.enforce_eager),
            attention_backend=backend.name,
            quantization=self.quantization,
        )
        platform.check_and_update_config(config)
        return config

    def _resolve_dtype(self, hf_config: Any, platform: Any) -> str:
        requested = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if requested == "auto":
            declared = getattr(hf_config, "dtype", None)
            if isinstance(declared, str):
                declared = getattr(torch, declared, None)
            return dtype_name(platform.default_dtype(declared))
        dtype = getattr(torch, requested, None)
        if not isinstance(dtype, torch.dtype) or dtype not in platform.supported_dtypes:
            names = [dtype_name(d) for d in platform.supported_dtypes]
            raise ValueError(
                f"dtype={self.dtype!r} is not supported on {platform.name}; use auto or one of {names}."
            )
        return requested

    def _resolve_max_model_len(self, model_cfg: ModelConfig) -> int:
        limit = getattr(model_cfg.text_config, "max_position_embeddings", None)
        if self.max_model_len is None:
            if limit is None:
                raise ValueError(
                    "The model config has no max_position_embeddings; pass max_model_len."
                )
            return int(limit)
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}.")
        if limit is not None and self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} is larger than the model's max_position_embeddings={limit}."
            )
        return self.max_model_len


def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}.")
