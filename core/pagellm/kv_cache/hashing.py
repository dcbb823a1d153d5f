"""Chained hashes of full KV blocks, for prefix caching.

Block i's hash covers its tokens and, through its parent's hash, every token before it, so equal
hashes mean equal prefixes. sha256 of a canonical byte encoding gives the same value in every
process (unlike Python's ``hash``). Extra keys are mixed in: the cache salt, in the first block,
and the hash of each multimodal item whose placeholder span overlaps the block (with where in the
block the span starts), so two prompts whose placeholder tokens agree but whose images differ
share no block.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pagellm.request import Request

ROOT_HASH = hashlib.sha256(b"pagellm-prefix-cache-root").digest()


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: list[int], extra_keys: tuple[str, ...] = ()
) -> bytes:
    token_bytes = np.asarray(token_ids, dtype=np.int64).tobytes()
    return _chain(parent_hash if parent_hash is not None else ROOT_HASH, token_bytes, extra_keys)


def _chain(parent_hash: bytes, token_bytes: bytes, extra_keys: tuple[str, ...]) -> bytes:
    """A block's hash: its parent's, its tokens as int64 bytes, then each extra key."""
    h = hashlib.sha256(parent_hash)
    h.update(token_bytes)
    for key in extra_keys:
        h.update(b"\x00" + key.encode())
    return h.digest()


def _extra_keys(request: Request, index: int, block_size: int) -> tuple[str, ...]:
    start = index * block_size
    keys = [f"salt:{request.cache_salt}"] if index == 0 and request.cache_salt else []
    for item in request.mm_items:
        if item.offset < start + block_size and item.end > start:
            keys.append(f"mm:{item.hash}@{item.offset - start}")
    return tuple(keys)


def make_block_hasher(block_size: int) -> Callable[[Request], list[bytes]]:
    """A function giving the hashes of a request's blocks that became full since the last call."""

    def hasher(request: Request) -> list[bytes]:
        start = len(request.block_hashes)
        num_full = request.num_tokens // block_size
        if num_full <= start:
            return []
        parent = request.block_hashes[-1] if start else ROOT_HASH
        # The new blocks' tokens as int64 bytes in one conversion (a prompt's 128 blocks
        # hashed in ~60 us rather than ~600): block i's bytes are the slice of its tokens, as
        # `hash_block_tokens` would convert them.
        data = np.asarray(
            request.token_slice(start * block_size, num_full * block_size), dtype=np.int64
        ).tobytes()
        width = block_size * 8
        any_extra = bool(request.cache_salt) or bool(request.mm_items)
        new_hashes = []
        for j, i in enumerate(range(start, num_full)):
            extra = _extra_keys(request, i, block_size) if any_extra else ()
            parent = _chain(parent, data[j * width : (j + 1) * width], extra)
            new_hashes.append(parent)
        return new_hashes

    hasher.block_size = block_size  # type: ignore[attr-defined]
    return hasher
