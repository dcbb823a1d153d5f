"""The KV cache's fast paths do what the slow ones did. `KVCacheManager.allocate_slots` across
prefill chunks and decode steps: the step that needs no new block returns at once, and still every
block is there and every full block is registered under its hash when it fills up (never before,
never later). `BlockPool.free_blocks` queues a request's blocks at once, in the order that queueing
them one by one gives."""

from __future__ import annotations

import random

import pytest

from pagellm.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from pagellm.kv_cache.hashing import make_block_hasher
from pagellm.kv_cache.manager import KVCacheManager, cdiv
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams

BLOCK = 4


def check_request(manager: KVCacheManager, request: Request, total: int) -> None:
    """The blocks of ``request`` hold ``total`` tokens; its full blocks with a hash are cached."""
    blocks = manager.req_to_blocks[request.request_id]
    assert len(blocks) == cdiv(total, BLOCK)
    if not manager.enable_caching:
        assert all(b.block_hash is None for b in blocks)
        return
    num_full = min(total // BLOCK, len(request.block_hashes))
    assert manager.num_cached_blocks.get(request.request_id, 0) == num_full
    cached = manager.block_pool.cached_block_hash_to_block
    for i, block in enumerate(blocks):
        if i < num_full:
            assert request.block_hashes[i] in cached
            assert block.block_hash in (None, request.block_hashes[i])
        else:
            assert block.block_hash is None


@pytest.mark.parametrize("enable_caching", [True, False])
def test_chunks_and_decode_steps_keep_blocks_and_prefix_hashes_right(enable_caching):
    rng = random.Random(5)
    manager = KVCacheManager(BLOCK, num_blocks=400, enable_caching=enable_caching)
    shared = [rng.randrange(1000) for _ in range(9)]  # a prefix that two requests compute apart
    requests = [
        Request(
            str(i),
            (shared if i < 2 else []) + [rng.randrange(1000) for _ in range(rng.randrange(1, 14))],
            SamplingParams(max_tokens=40),
            None,
            block_hasher=make_block_hasher(BLOCK),
        )
        for i in range(6)
    ]
    empty_returns = 0
    for _ in range(40):
        for request in requests:
            left = request.num_tokens - request.num_computed_tokens
            num_new = min(left, rng.randrange(1, 7)) if left > 1 else 1
            before = len(manager.req_to_blocks.get(request.request_id, []))
            new_blocks = manager.allocate_slots(request, num_new)
            assert new_blocks is not None
            empty_returns += not new_blocks
            total = request.num_computed_tokens + num_new
            assert len(new_blocks) == cdiv(total, BLOCK) - before
            check_request(manager, request, total)
            request.num_computed_tokens = total
            if total == request.num_tokens:  # sampled a token
                request.append_output_token(rng.randrange(1000))
    assert empty_returns > 100  # most steps needed no block
    for request in requests:
        manager.free(request)
    assert manager.num_free_blocks == manager.block_pool.num_blocks - 1


def test_block_filled_by_a_decode_step_is_registered_in_that_step():
    manager = KVCacheManager(BLOCK, num_blocks=8, enable_caching=True)
    request = Request("r", [1, 2, 3], SamplingParams(), None, block_hasher=make_block_hasher(4))
    assert manager.allocate_slots(request, 3)  # a block, not yet full
    request.num_computed_tokens = 3
    request.append_output_token(4)  # the prompt's sample fills the block
    assert manager.allocate_slots(request, 1) == []  # its slot is in the block
    (block,) = manager.req_to_blocks["r"]
    assert block.block_hash == request.block_hashes[0]
    request.num_computed_tokens = 4
    request.append_output_token(5)
    assert len(manager.allocate_slots(request, 1) or []) == 1


def test_free_blocks_queues_blocks_as_one_by_one_would():
    rng = random.Random(9)
    pool = BlockPool(41)
    blocks = pool.get_new_blocks(40)
    pool.cache_full_blocks(blocks, [bytes([i]) for i in range(40)], 0, 40)
    for block in rng.sample(blocks, 20):
        pool.uncache(block)
    rng.shuffle(blocks)
    pool.free_blocks(blocks[:10])  # queued on an empty queue, then onto both of its ends
    pool.free_blocks(blocks[10:])

    mirror = [KVCacheBlock(b.block_id) for b in blocks]
    reference = FreeBlockQueue([])
    for original, block in zip(blocks, mirror, strict=True):
        (reference.appendleft if original.block_hash is None else reference.append)(block)
    assert [b.block_id for b in pool.free_block_queue] == [b.block_id for b in reference]
    assert pool.get_num_free_blocks() == 40
    # The backward links too: removing from the middle relinks both neighbours.
    removed = set(rng.sample([b.block_id for b in blocks], 15))
    for block in blocks:
        if block.block_id in removed:
            pool.free_block_queue.remove(block)
    expected = [b.block_id for b in reference if b.block_id not in removed]
    assert [b.block_id for b in pool.free_block_queue] == expected
    assert [pool.free_block_queue.popleft().block_id for _ in expected] == expected
