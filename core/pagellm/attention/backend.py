"""The attention backend interface: what a backend declares, builds per step, and computes per layer.

A backend is a class with class-level capability declarations, an `AttentionImpl` (per layer:
write the new K/V into the paged cache, attend) and an `AttentionMetadataBuilder` (per step: turn
the model runner's `CommonAttentionMetadata` into whatever the kernels want, once for all layers).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from pagellm.kv_cache.spec import KVCacheSpec


@dataclass
class CommonAttentionMetadata:
    """The batch as the model runner laid it out; requests are rows, tokens are flattened. Names
    as in vLLM. In a graph replay's padded batch, the padding rows count in ``num_reqs`` and
    ``num_actual_tokens`` (see `AttentionMetadataBuilder.build_for_cudagraph`)."""

    num_reqs: int
    num_actual_tokens: int
    """Tokens computed this step: the length of ``slot_mapping`` and of the model's inputs."""
    max_query_len: int
    """The most tokens one request computes this step (1: a decode-only step)."""
    max_seq_len: int
    """The longest ``seq_lens`` entry."""
    query_start_loc: torch.Tensor
    """[num_reqs + 1] int32 on the device: request i's tokens are [qsl[i], qsl[i+1])."""
    query_start_loc_cpu: torch.Tensor
    """The same on the host (read it for decisions: no device sync)."""
    seq_lens: torch.Tensor
    """[num_reqs] int32 on the device: context length after this step (cached + new tokens)."""
    seq_lens_cpu: torch.Tensor
    """The same on the host."""
    block_table: torch.Tensor
    """[num_reqs, max_blocks] int32 on the device, padded with the null block (0)."""
    slot_mapping: torch.Tensor
    """[num_actual_tokens] int64 on the device: where each new token's K/V goes in the cache."""


class AttentionMetadataBuilder(ABC):
    def __init__(self, kv_cache_spec: KVCacheSpec, device: torch.device) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.device = device

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> Any:
        """Per-step metadata shared by every attention layer."""

    def build_for_cudagraph(self, common: CommonAttentionMetadata) -> Any:
        """Metadata for a decode-only batch that is captured once and replayed many times.

        ``common`` then describes a padded batch whose tensors are views of the model runner's
        persistent buffers: between replays the runner rewrites their contents in place, never
        their addresses or shapes. So the returned metadata may hold only those tensors (or views
        of them) and scratch buffers the builder keeps for its lifetime; host-side values
        (``max_seq_len``, ``max_query_len``) are the capture-time worst case (``max_seq_len`` is
        ``max_model_len``). Padding rows have a query length of 1, a ``seq_len`` of 0 and a
        ``slot_mapping`` of -1: kernels must skip them without reading the cache. Only backends
        with ``cudagraph_support`` are asked."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs.")

    def prepare_cudagraph_replay(  # noqa: B027 (optional hook: most backends need nothing)
        self, attn_metadata: Any, common: CommonAttentionMetadata
    ) -> None:
        """Called before every replay of a graph captured with ``attn_metadata`` (what
        `build_for_cudagraph` returned), with the step's padded batch: ``common``'s device tensors
        are the persistent buffers, already holding the step's contents, and its host values are
        the step's own. Host-side planning the graph cannot do goes here, such as rewriting, in
        place, index buffers the captured kernels read; launch shapes must stay as captured. The
        default does nothing: kernels that read ``seq_lens`` and the block table on the device
        need nothing more."""


class AttentionImpl(ABC):
    writes_into_output: bool = False
    """Whether ``forward`` takes an ``output`` keyword (a contiguous [T, num_heads * head_size]
    tensor of the query's dtype) and writes its result there, returning it. Piecewise graphs
    hand attention such a buffer; an implementation without it has its result copied there."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None,
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.k_scale = 1.0
        self.v_scale = 1.0
        """Per-layer scales of a quantized KV cache (stored = value / scale), set by the layer
        once the weights are loaded; a cache in the model dtype ignores them."""
        self.causal = True
        """False for an encoder's bidirectional attention: each token attends to every token of
        its prompt, which the step holds whole (pooling models run without chunked prefill or
        prefix caching). Set by the layer; only backends with ``supports_non_causal`` see it."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> torch.Tensor:
        """query [T, num_heads * head_size], key/value [T, num_kv_heads * head_size] for the new
        tokens; store key/value in ``kv_cache`` at the slot mapping and return [T, num_heads * head_size].
        A ``kv_cache`` in float8_e4m3fn stores key / ``k_scale`` and value / ``v_scale``, saturated
        to the format's range, and is read back multiplied by the scales."""


class AttentionBackend(ABC):
    """Capabilities are class attributes so selection can check them without building anything."""

    name: ClassVar[str]
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.float32,
        torch.float16,
        torch.bfloat16,
    )
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = None
    """None: any head size."""
    block_size_multiple: ClassVar[int] = 1
    """Block sizes must be a multiple of this."""
    default_block_size: ClassVar[int] = 16
    supports_sliding_window: ClassVar[bool] = True
    supports_non_causal: ClassVar[bool] = False
    """True when the impl honours ``AttentionImpl.causal = False`` (bidirectional attention
    over each prompt, for encoder models such as BERT); the selector refuses a backend without
    it for such a model (outside `unsupported_reasons`, so that overrides of it written before
    this declaration keep their signature)."""
    supported_device_types: ClassVar[tuple[str, ...]] = ("cpu",)
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    """The KV cache dtypes (``--kv-cache-dtype`` names) the backend writes and reads: ``auto``
    is the model dtype; ``fp8_e4m3`` a float8 e4m3 cache with per-layer k/v scales."""
    cudagraph_support: ClassVar[bool] = False
    """True when decode-only batches may be captured in a CUDA graph: see
    `AttentionMetadataBuilder.build_for_cudagraph`."""

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]: ...

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]: ...

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]: ...

    @staticmethod
    def allocate_kv_cache(
        shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """One layer's KV cache; the default zero-fills it."""
        return torch.zeros(shape, dtype=dtype, device=device)

    @classmethod
    def default_block_size_for(cls, kv_cache_dtype: str = "auto") -> int:
        """The block size when the user gives none (``--block-size``), for a KV cache of
        ``kv_cache_dtype``: `default_block_size` unless a backend reads one cache dtype faster
        in other pages (a multiple of `block_size_multiple`)."""
        return cls.default_block_size

    @classmethod
    def is_available(cls) -> str | None:
        """None when the backend's libraries import here; otherwise why not."""
        return None

    @classmethod
    def unsupported_reasons(
        cls,
        *,
        device_type: str,
        head_size: int,
        dtype: torch.dtype,
        block_size: int | None,
        sliding_window: int | None,
        kv_cache_dtype: str = "auto",
    ) -> list[str]:
        """Every reason this backend cannot serve the model; empty when it can."""
        reasons = []
        unavailable = cls.is_available()
        if unavailable:
            reasons.append(unavailable)

        def unsupported(what: str, supported: object) -> None:
            reasons.append(f"{what} not supported (supports {supported})")

        if device_type not in cls.supported_device_types:
            unsupported(f"device {device_type!r}", list(cls.supported_device_types))
        if dtype not in cls.supported_dtypes:
            names = [str(d).removeprefix("torch.") for d in cls.supported_dtypes]
            unsupported(f"dtype {str(dtype).removeprefix('torch.')}", names)
        if cls.supported_head_sizes is not None and head_size not in cls.supported_head_sizes:
            unsupported(f"head size {head_size}", list(cls.supported_head_sizes))
        if block_size is not None and block_size % cls.block_size_multiple:
            unsupported(f"block_size {block_size}", f"multiples of {cls.block_size_multiple}")
        if sliding_window is not None and not cls.supports_sliding_window:
            reasons.append("sliding window attention not supported")
        if kv_cache_dtype not in cls.supported_kv_cache_dtypes:
            unsupported(f"kv cache dtype {kv_cache_dtype}", list(cls.supported_kv_cache_dtypes))
        return reasons
