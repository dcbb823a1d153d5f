"""Multimodal items as the engine carries them, and what a model says it takes.

A `MultiModalItem` is one preprocessed input (an image's pixel tensor) and the span of the prompt
its embeddings fill: ``length`` placeholder tokens from ``offset``. It crosses the engine-core
process boundary and the executor's as a msgspec struct, its tensor as raw bytes with shape and
dtype (no pickle). Its ``hash`` (of the tensor's dtype, shape and bytes) keys the workers'
encoder cache and enters the prefix-cache hashes of the KV blocks its span overlaps.

A model that takes such items says how through `MultiModalSpec` (its class's
``multimodal_spec(hf_config)``): which placeholder token stands for an item and how many
embeddings one item gives.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint8": torch.uint8,
}


class MultiModalItem(msgspec.Struct, array_like=True, frozen=True):
    modality: str
    """What it is ("image"): the model's encoder for that modality embeds it."""
    offset: int
    """The prompt position of its first placeholder token."""
    length: int
    """Its placeholder tokens: as many as the embeddings its encoder gives."""
    data: bytes
    """The tensor's bytes, C order."""
    shape: list[int]
    dtype: str
    """A torch dtype's name without ``torch.`` (``float32``)."""
    hash: str
    """Hex sha256 of dtype, shape and bytes: equal tensors, equal hashes, in every process."""

    @classmethod
    def from_tensor(
        cls, modality: str, tensor: torch.Tensor, offset: int, length: int
    ) -> MultiModalItem:
        tensor = tensor.detach().cpu().contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise ValueError(f"A multimodal item cannot carry a {dtype} tensor.")
        data = _tensor_bytes(tensor)
        shape = list(tensor.shape)
        return cls(modality, offset, length, data, shape, dtype, _content_hash(dtype, shape, data))

    @property
    def end(self) -> int:
        """The prompt position just past its span."""
        return self.offset + self.length

    def tensor(self) -> torch.Tensor:
        """The tensor, on the CPU (a copy: the bytes stay read-only)."""
        dtype = _DTYPES[self.dtype]
        flat = torch.frombuffer(bytearray(self.data), dtype=dtype)
        return flat.reshape(self.shape)


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: carry its 16-bit patterns
        return tensor.view(torch.int16).numpy().tobytes()
    return tensor.numpy().tobytes()


def _content_hash(dtype: str, shape: list[int], data: bytes) -> str:
    h = hashlib.sha256(dtype.encode())
    h.update(np.asarray(shape, dtype=np.int64).tobytes())
    h.update(data)
    return h.hexdigest()


@dataclass(frozen=True)
class MultiModalSpec:
    """What a model takes for one modality."""

    modality: str
    placeholder_token_id: int
    """The token that stands for one of the item's embeddings in the prompt."""
    tokens_per_item: int
    """The embeddings one item gives (its placeholder tokens)."""
    item_shape: tuple[int, ...]
    """The shape of one item's tensor (an image's: channels × height × width)."""


def multimodal_specs(model_cls: type, hf_config: Any) -> list[MultiModalSpec]:
    """What the model class takes (its ``multimodal_specs(hf_config)``); none for text only."""
    specs_of = getattr(model_cls, "multimodal_specs", None)
    return list(specs_of(hf_config)) if specs_of is not None else []


def check_items(
    token_ids: Sequence[int], items: Sequence[MultiModalItem], specs: Sequence[MultiModalSpec]
) -> None:
    """``ValueError`` unless the items fit the prompt: each of a modality the model takes, with
    its span of that modality's placeholder tokens, in prompt order without overlap, and no
    placeholder token outside the items' spans."""
    by_modality = {spec.modality: spec for spec in specs}
    if items and not by_modality:
        raise ValueError("This model takes no multimodal input: send text or token ids only.")
    covered = 0
    previous_end = 0
    for i, item in enumerate(items):
        if not isinstance(item, MultiModalItem):
            raise ValueError(f"multi_modal_items[{i}] is a {type(item).__name__}, not an item.")
        spec = by_modality.get(item.modality)
        if spec is None:
            raise ValueError(
                f"multi_modal_items[{i}] is of modality {item.modality!r}; this model takes "
                f"{', '.join(sorted(by_modality))}."
            )
        if tuple(item.shape) != spec.item_shape:
            raise ValueError(
                f"multi_modal_items[{i}] has shape {tuple(item.shape)}; a {item.modality} of "
                f"this model is {spec.item_shape}."
            )
        if item.length != spec.tokens_per_item:
            raise ValueError(
                f"multi_modal_items[{i}] spans {item.length} tokens; a {item.modality} of this "
                f"model is {spec.tokens_per_item}."
            )
        if item.offset < previous_end or item.end > len(token_ids):
            raise ValueError(
                f"multi_modal_items[{i}]'s span [{item.offset}, {item.end}) overlaps another "
                f"item or leaves the prompt of {len(token_ids)} tokens."
            )
        span = token_ids[item.offset : item.end]
        if any(t != spec.placeholder_token_id for t in span):
            raise ValueError(
                f"multi_modal_items[{i}]'s span [{item.offset}, {item.end}) is not made of the "
                f"{item.modality} placeholder token {spec.placeholder_token_id}."
            )
        covered += item.length
        previous_end = item.end
    placeholders = {spec.placeholder_token_id for spec in specs}
    if not placeholders:  # a text-only model: nothing to count
        return
    ids = token_ids if isinstance(token_ids, list) else list(token_ids)
    total = sum(ids.count(p) for p in placeholders)  # at C speed over a long prompt
    if total != covered:
        raise ValueError(
            f"The prompt has {total - covered} multimodal placeholder token(s) that no item "
            "fills: each placeholder must come with its item (an image for an image token)."
        )
