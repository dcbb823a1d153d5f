"""What every attention kernel of this backend offers, and the facts it is chosen by.

A kernel is one library's paged attention over this backend's KV layout (`[num_blocks,
block_size, num_kv_heads, head_size]` per K and per V): a FlashAttention provider (FA4, FA3,
FA2), which serves every phase, or a decode-only kernel (TRITON). Its library is imported once
per process, on first probe; the probe's outcome (the module, or why not) is kept.
"""

from __future__ import annotations

import importlib.metadata
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from pagellm.attention.backend import CommonAttentionMetadata
from pagellm.kv_cache.spec import KVCacheSpec

if TYPE_CHECKING:
    from pagellm_flash_attn.metadata import FlashAttnMetadata


class KernelUnavailable(Exception):
    """A kernel's library does not import here, or is too old; the message says why."""


@dataclass(frozen=True)
class LayerParams:
    """What a kernel call needs to know of the attention layer calling it."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None

    @property
    def window_left(self) -> int | None:
        """FlashAttention's left window: a query at position p sees keys p - left .. p."""
        return None if self.sliding_window is None else self.sliding_window - 1


def dist_version(distribution: str) -> str | None:
    """The installed version of a pip distribution, or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_capability(device: torch.device | None = None) -> tuple[int, int] | None:
    """The compute capability of ``device`` (default: the current CUDA device), or None when it
    is not a CUDA GPU. Initialises CUDA in this process."""
    if (device is not None and device.type != "cuda") or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major, minor


def sm_name(capability: tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"


_PROBES: dict[type[AttentionKernel], tuple[Any, str | None]] = {}
"""Per kernel class: (its imported library, None), or (None, why it is unavailable)."""


class AttentionKernel(ABC):
    name: ClassVar[str]
    """As in log lines, measurements and ``PAGELLM_FLASH_ATTN_PREFILL``/``_DECODE``."""
    library: ClassVar[str]
    """The pip distribution it comes from."""
    serves_prefill: ClassVar[bool] = True
    """False for a decode-only kernel: it attends rows of one query token only."""
    leaves_decode_rows: ClassVar[bool] = False
    """Its `prefill` can skip the one-token rows of a mixed step, for another kernel to serve."""
    decodes_into: ClassVar[bool] = False
    """Its `decode` with ``out`` writes only the one-token rows, leaving the others as they are."""

    # ------------------------------------------------------------------ availability

    @classmethod
    @abstractmethod
    def _import(cls) -> Any:
        """Import the library; raise `KernelUnavailable` (or ImportError) saying why not."""

    @classmethod
    def probe(cls) -> Any:
        """The imported library (imported on the first call); raises `KernelUnavailable`."""
        if cls not in _PROBES:
            try:
                _PROBES[cls] = (cls._import(), None)
            except KernelUnavailable as exc:
                _PROBES[cls] = (None, str(exc))
            except ImportError as exc:
                _PROBES[cls] = (None, f"{cls.library} does not import ({exc})")
        library, reason = _PROBES[cls]
        if reason is not None:
            raise KernelUnavailable(reason)
        return library

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            cls.probe()
        except KernelUnavailable as exc:
            return f"{cls.name}: {exc}"
        return None

    @classmethod
    def version(cls) -> str:
        return dist_version(cls.library) or "?"

    @classmethod
    @abstractmethod
    def unsupported_gpu(cls, capability: tuple[int, int]) -> str | None:
        """Why this kernel does not run on a GPU of ``capability``; None if it does."""

    @classmethod
    def unsupported_shape(
        cls, capability: tuple[int, int], head_size: int, block_size: int
    ) -> list[str]:
        """Why this kernel cannot serve a model's head and block sizes on a GPU it runs on."""
        return []

    @classmethod
    def splits_kv(cls, capability: tuple[int, int]) -> bool:
        """Whether its decode splits a row's keys over several programs on this GPU."""
        return False

    # ------------------------------------------------------------------ per step, per layer

    def __init__(
        self, kv_cache_spec: KVCacheSpec, device: torch.device, capability: tuple[int, int]
    ) -> None:
        """``capability``: the GPU's, which some kernels pick launch options by (FA4 splits
        decode rows on sm_100 only)."""
        self.lib = self.probe()
        self.kv_cache_spec = kv_cache_spec
        self.device = device

    def plan_prefill(self, common: CommonAttentionMetadata) -> Any:
        """Per-step device arrays its `prefill` needs beyond the common ones (once per step)."""
        return None

    def plan_decode(
        self, common: CommonAttentionMetadata, num_decode_rows: int, for_graph: bool
    ) -> Any:
        """Per-step choices of its `decode` (split counts and scratch). ``for_graph``: the plan
        is captured and replayed, so it may hold only what lives as long as the kernel."""
        return None

    def prepare_replay(self, plan: Any, common: CommonAttentionMetadata) -> None:  # noqa: B027
        """Before each replay of a graph captured with ``plan`` (from ``plan_decode(...,
        for_graph=True)``), with the replay's padded batch: rewrite, in place, what the plan's
        buffers hold for this step. The default has nothing to rewrite."""

    def prefill(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: FlashAttnMetadata,
        layer: LayerParams,
        seqused_q: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of every row of the step (rows of several tokens only, when ``seqused_q``
        gives the one-token rows 0 tokens); returns ``[num_tokens, num_heads, head_size]``:
        ``out`` where given and the kernel can write there, else a tensor of its own (the
        caller copies it)."""
        raise NotImplementedError(f"{self.name} is a decode-only kernel")

    @abstractmethod
    def decode(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: FlashAttnMetadata,
        layer: LayerParams,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention of the rows of one query token: every row of a decode-only step, or (with
        ``out``, for a kernel that `decodes_into`) the one-token rows of a mixed step, written
        into ``out``. Returns the output: in a decode-only step a kernel may ignore ``out`` and
        return a tensor of its own (the caller copies it)."""
