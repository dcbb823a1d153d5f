"""Multimodal items in a step: which rows of the step's tokens are an item's embeddings, and the
encoder cache that keeps those embeddings between steps.

A request's prompt holds each item as a span of placeholder tokens. A step may compute any part of
a span (chunked prefill cuts through it; a prefix-cache hit or a preemption restarts inside it):
the item's embeddings are computed whole, once, kept in the `EncoderCache` under the item's hash,
and each step takes the rows its tokens cover. A repeated item (the same image in another request)
is found there and not encoded again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from pagellm.multimodal.inputs import MultiModalItem
from pagellm.worker.input_batch import CachedRequestState, InputBatch
from pagellm.worker.step_inputs import StepPlan


class EncoderCache:
    """Item embeddings on the device by item hash, the least recently used evicted first once
    they hold more than ``max_tokens`` rows (the newest entry always stays)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_tokens = 0
        self.hits = 0
        """Lookups answered without encoding (a later chunk, a repeated item)."""
        self.misses = 0
        """Items encoded."""

    def get(self, key: str) -> torch.Tensor | None:
        embeddings = self.entries.get(key)
        if embeddings is not None:
            self.entries.move_to_end(key)
            self.hits += 1
        return embeddings

    def put(self, key: str, embeddings: torch.Tensor) -> None:
        self.misses += 1
        self.entries[key] = embeddings
        self.num_tokens += embeddings.shape[0]
        while self.num_tokens > self.max_tokens and len(self.entries) > 1:
            _, evicted = self.entries.popitem(last=False)
            self.num_tokens -= evicted.shape[0]

    def stats(self) -> dict[str, int]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "entries": len(self.entries),
            "tokens": self.num_tokens,
        }


@dataclass
class StepEmbeddings:
    """Rows of the step's flattened tokens (``index``) and the embeddings that replace theirs."""

    index: torch.Tensor
    values: torch.Tensor


@dataclass
class _Piece:
    item: MultiModalItem
    dst: int
    """Where the piece starts in the step's flattened tokens."""
    first: int
    """The item's first embedding row the piece takes."""
    count: int


class MultiModalInputs:
    """The step's item embeddings, through the encoder cache (one per model runner)."""

    def __init__(self, cache: EncoderCache, device: torch.device) -> None:
        self.cache = cache
        self.device = device

    def for_step(
        self,
        plan: StepPlan,
        batch: InputBatch,
        requests: dict[str, CachedRequestState],
        model: Any,
        dtype: torch.dtype,
    ) -> StepEmbeddings | None:
        """The embeddings of the item spans the step's tokens cover, or None when they cover
        none (the step then runs as text)."""
        pieces: list[_Piece] = []
        query_start = plan.query_start
        for pos, req_id in enumerate(plan.req_ids):
            items = requests[req_id].mm_items
            if not items:
                continue
            start = int(batch.num_computed_tokens[plan.rows[pos]])
            end = start + int(plan.query_lens[pos])
            for item in items:
                lo, hi = max(start, item.offset), min(end, item.end)
                if lo < hi:
                    dst = int(query_start[pos]) + lo - start
                    pieces.append(_Piece(item, dst, lo - item.offset, hi - lo))
        if not pieces:
            return None
        embeddings = self._embeddings([p.item for p in pieces], model, dtype)
        index = torch.cat([torch.arange(p.dst, p.dst + p.count) for p in pieces])
        values = torch.cat([embeddings[p.item.hash][p.first : p.first + p.count] for p in pieces])
        return StepEmbeddings(index.to(self.device), values)

    def _embeddings(
        self, items: list[MultiModalItem], model: Any, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        """Each item's embeddings: from the cache, else encoded (items of one modality and
        shape in one batch) and cached."""
        found: dict[str, torch.Tensor] = {}
        missing: dict[str, MultiModalItem] = {}
        for item in items:
            cached = None if item.hash in missing else self.cache.get(item.hash)
            if cached is not None:
                found[item.hash] = cached
            elif item.hash in missing:
                self.cache.hits += 1  # a second piece of an item encoded for this step
            else:
                missing[item.hash] = item
        groups: dict[tuple[str, tuple[int, ...]], list[MultiModalItem]] = {}
        for item in missing.values():
            groups.setdefault((item.modality, tuple(item.shape)), []).append(item)
        for (modality, _), group in groups.items():
            pixels = torch.stack([item.tensor() for item in group])
            encoded = model.embed_multimodal(modality, pixels.to(self.device, dtype))
            for item, rows in zip(group, encoded, strict=True):
                if rows.shape[0] != item.length:
                    raise ValueError(
                        f"The model gave {rows.shape[0]} embeddings for a {modality} whose "
                        f"prompt span has {item.length} placeholders."
                    )
                self.cache.put(item.hash, rows)
                found[item.hash] = rows
        return found
