"""Unit tests for the KV block pool, the free-block queue, block hashing and the KV cache manager."""

from __future__ import annotations

import pytest

from pagellm.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from pagellm.kv_cache.hashing import hash_block_tokens, make_block_hasher
from pagellm.kv_cache.manager import KVCacheManager
from pagellm.kv_cache.residency import KVBlockEviction, KVBlockResidency
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams


def make_request(request_id, tokens, block_size=4, cache_salt=None, hashed=True):
    return Request(
        request_id,
        tokens,
        SamplingParams(temperature=0, max_tokens=8),
        eos_token_id=None,
        cache_salt=cache_salt,
        block_hasher=make_block_hasher(block_size) if hashed else None,
    )


def free_ids(pool):
    return [b.block_id for b in pool.free_block_queue]


def check_pool(pool):
    """Structural invariants of a pool: queue links, ref counts, the hash map."""
    queued = list(pool.free_block_queue)
    assert len(queued) == pool.get_num_free_blocks()
    assert len({b.block_id for b in queued}) == len(queued)
    assert pool.null_block not in queued
    for block in pool.blocks[1:]:
        if block in queued:
            assert block.ref_cnt == 0
        else:
            assert block.ref_cnt > 0
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash
    for block in pool.blocks:
        if block.block_hash is not None:
            assert pool.cached_block_hash_to_block[block.block_hash] is block


# ---------------------------------------------------------------------------- FreeBlockQueue


def test_free_queue_pops_in_order_and_removes_from_the_middle():
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    assert queue.num_free_blocks == 4
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    queue.appendleft(blocks[2])
    assert [b.block_id for b in queue] == [2, 0, 1, 3]
    assert [queue.popleft().block_id for _ in range(4)] == [2, 0, 1, 3]
    assert queue.num_free_blocks == 0


def test_free_queue_rejects_popping_when_empty_and_removing_a_non_member():
    block = KVCacheBlock(1)
    queue = FreeBlockQueue([])
    with pytest.raises(ValueError):
        queue.popleft()
    with pytest.raises(RuntimeError):
        queue.remove(block)
    assert queue.num_free_blocks == 0


# ---------------------------------------------------------------------------- BlockPool


def test_pool_needs_at_least_two_blocks():
    with pytest.raises(ValueError):
        BlockPool(1)


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0
    assert pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(4)
    assert sorted(b.block_id for b in blocks) == [1, 2, 3, 4]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    # Freeing (or touching) the null block is a no-op: it never enters the free queue.
    pool.free_blocks([pool.null_block])
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == 4
    assert 0 not in free_ids(pool)
    check_pool(pool)


def test_get_new_blocks_asking_for_too_many_changes_nothing():
    pool = BlockPool(4)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert pool.get_num_free_blocks() == 3
    check_pool(pool)


def test_freed_hashed_blocks_go_to_tail_unhashed_to_head():
    pool = BlockPool(6)
    b1, b2, b3, b4, b5 = pool.get_new_blocks(5)
    pool.cache_full_blocks([b1, b2], [b"h1", b"h2"], 0, 2)
    assert pool.get_num_free_blocks() == 0
    pool.free_blocks([b1, b3, b2, b4])
    # Unhashed ones were pushed to the head (latest first), hashed ones appended in free order.
    assert free_ids(pool) == [b4.block_id, b3.block_id, b1.block_id, b2.block_id]
    # Eviction order: unhashed blocks first, then the least recently freed hashed block.
    assert pool.get_new_blocks(1) == [b4]
    assert pool.get_new_blocks(1) == [b3]
    assert pool.get_new_blocks(1) == [b1]
    assert pool.get_cached_block(b"h1") is None
    assert pool.get_cached_block(b"h2") is b2
    check_pool(pool)


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def test_residency_reports_a_sampled_cached_block_when_it_is_evicted():
    clock = Clock()
    # Follow the first block, not the second; when reused, the first again; at last neither.
    draws = iter([0.0, 0.9, 0.9, 0.0, 0.9, 0.9])
    residency = KVBlockResidency(0.5, clock=clock, draw=lambda: next(draws))
    pool = BlockPool(3, residency)
    followed, unfollowed = pool.get_new_blocks(2)
    pool.cache_full_blocks([followed, unfollowed], [b"f", b"u"], 0, 2)
    pool.free_blocks([followed, unfollowed])
    for now in (11.0, 13.0, 16.5):  # three prefix-cache hits
        clock.now = now
        pool.touch([followed])
        pool.free_blocks([followed])
    assert residency.take_evictions() == []
    clock.now = 20.0
    assert pool.get_new_blocks(2) == [unfollowed, followed]  # both evicted, one followed
    assert residency.take_evictions() == [
        KVBlockEviction(lifetime_s=10.0, idle_s=3.5, reuse_gaps_s=[2.0, 3.5])
    ]
    assert residency.take_evictions() == []
    # Handed out again without a cached prefix (never registered): not an eviction.
    pool.free_blocks([followed, unfollowed])
    pool.get_new_blocks(2)
    assert residency.take_evictions() == []


def test_residency_forgets_every_block_when_the_prefix_cache_is_reset():
    residency = KVBlockResidency(1.0)
    pool = BlockPool(3, residency)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"a", b"b"], 0, 2)
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    pool.get_new_blocks(2)
    assert residency.take_evictions() == []


def test_prefix_hit_on_free_cached_block_revives_it():
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [b"h"], 0, 1)
    pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert block in list(pool.free_block_queue)
    assert pool.get_cached_block(b"h") is block  # still findable while free
    assert pool.get_num_free_blocks() == 3

    pool.touch([pool.get_cached_block(b"h")])
    assert block.ref_cnt == 1
    assert block not in list(pool.free_block_queue)
    assert pool.get_num_free_blocks() == 2
    assert block.block_hash == b"h"

    pool.touch([block])  # a second sharer: just another reference
    assert block.ref_cnt == 2
    assert pool.get_num_free_blocks() == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert block not in list(pool.free_block_queue)
    check_pool(pool)


def test_evicting_a_hashed_block_removes_it_from_the_hash_map():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [b"ha", b"hb"], 0, 2)
    pool.free_blocks([a, b])
    assert set(pool.cached_block_hash_to_block) == {b"ha", b"hb"}
    (reused,) = pool.get_new_blocks(1)
    assert reused is a
    assert a.block_hash is None
    assert pool.get_cached_block(b"ha") is None
    assert pool.get_cached_block(b"hb") is b
    pool.get_new_blocks(1)
    assert pool.cached_block_hash_to_block == {}
    check_pool(pool)


def test_cache_full_blocks_keeps_the_first_block_for_a_duplicate_hash():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"same"], 0, 1)
    pool.cache_full_blocks([b], [b"same"], 0, 1)
    assert pool.get_cached_block(b"same") is a
    assert b.block_hash is None
    # The duplicate was never registered, so it goes to the head when freed and evicting it
    # leaves the registered block alone.
    pool.free_blocks([a, b])
    assert free_ids(pool)[0] == b.block_id
    assert pool.get_new_blocks(1) == [b]
    assert pool.get_cached_block(b"same") is a
    check_pool(pool)


def test_double_free_raises():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError, match="Double free"):
        pool.free_blocks([block])
    assert pool.get_num_free_blocks() == 2
    check_pool(pool)


def test_reset_prefix_cache_fails_while_blocks_in_use():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [b"ha", b"hb"], 0, 2)
    pool.free_blocks([a])
    assert not pool.reset_prefix_cache()
    assert pool.get_cached_block(b"ha") is a  # nothing forgotten
    assert b.block_hash == b"hb"

    pool.free_blocks([b])
    assert pool.reset_prefix_cache()
    assert pool.cached_block_hash_to_block == {}
    assert all(blk.block_hash is None for blk in pool.blocks)
    assert pool.get_num_free_blocks() == 3
    check_pool(pool)


# ---------------------------------------------------------------------------- hashing


def test_block_hasher_hashes_only_full_blocks_incrementally():
    request = make_request("r", [1, 2, 3, 4, 5, 6], block_size=4)
    assert len(request.block_hashes) == 1
    assert request.block_hashes[0] == hash_block_tokens(None, [1, 2, 3, 4])
    first = request.block_hashes[0]
    request.append_output_token(7)
    assert request.block_hashes == [first]
    request.append_output_token(8)
    assert len(request.block_hashes) == 2
    assert request.block_hashes[1] == hash_block_tokens(first, [5, 6, 7, 8])


def test_block_hashes_are_chained():
    a = make_request("a", [1, 1, 1, 1, 2, 2, 2, 2])
    b = make_request("b", [3, 3, 3, 3, 2, 2, 2, 2])
    c = make_request("c", [1, 1, 1, 1, 2, 2, 2, 2, 9])
    assert a.block_hashes[1] != b.block_hashes[1]  # same content, different prefix
    assert a.block_hashes == c.block_hashes[:2]


def test_cache_salt_changes_the_first_block_hash():
    tokens = list(range(8))
    plain = make_request("p", tokens)
    salted = make_request("s", tokens, cache_salt="x")
    salted_again = make_request("t", tokens, cache_salt="x")
    other_salt = make_request("u", tokens, cache_salt="y")
    assert plain.block_hashes[0] != salted.block_hashes[0]
    assert plain.block_hashes[1] != salted.block_hashes[1]  # through the chain
    assert salted.block_hashes == salted_again.block_hashes
    assert other_salt.block_hashes[0] != salted.block_hashes[0]


def test_the_block_hasher_equals_the_per_block_chain_with_salt_and_items():
    """The hasher converts a request's new blocks in one go; its hashes are the chain of
    `hash_block_tokens` over each block, with the salt in block 0 and each item's key in the
    blocks its span overlaps, also as output tokens fill blocks one by one."""
    import torch

    from pagellm.kv_cache.hashing import _extra_keys
    from pagellm.multimodal.inputs import MultiModalItem

    tokens = [
        int(t) for t in torch.randint(0, 50_000, (37,), generator=torch.Generator().manual_seed(0))
    ]
    item = MultiModalItem.from_tensor("image", torch.ones(2, 3), offset=6, length=7)
    request = Request(
        "r",
        tokens,
        SamplingParams(temperature=0, max_tokens=8),
        eos_token_id=None,
        cache_salt="salt",
        mm_items=[item],
        block_hasher=make_block_hasher(4),
    )
    for token in (7, 70_000, 3):
        request.append_output_token(token)
    expected, parent = [], None
    all_ids = tokens + [7, 70_000, 3]
    for i in range(len(all_ids) // 4):
        parent = hash_block_tokens(parent, all_ids[4 * i : 4 * i + 4], _extra_keys(request, i, 4))
        expected.append(parent)
    assert request.block_hashes == expected and len(expected) == 10
    assert _extra_keys(request, 0, 4) == ("salt:salt",)
    assert [len(_extra_keys(request, i, 4)) for i in range(1, 5)] == [1, 1, 1, 0]  # span 6..13


# ---------------------------------------------------------------------------- KVCacheManager


def run_prefill(manager, request):
    """Take the prefix hits and allocate the rest of the prompt, as the scheduler does."""
    hits, num_hit = manager.get_computed_blocks(request)
    blocks = manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hits)
    assert blocks is not None
    request.num_computed_tokens = request.num_tokens
    return hits, num_hit


def test_get_computed_blocks_caps_hit_below_a_fully_cached_prompt():
    manager = KVCacheManager(block_size=4, num_blocks=10, enable_caching=True)
    tokens = list(range(12))  # exactly 3 full blocks
    first = make_request("a", tokens)
    run_prefill(manager, first)
    assert manager.block_pool.get_cached_block(first.block_hashes[2]) is not None

    hits, num_hit = manager.get_computed_blocks(make_request("b", tokens))
    assert num_hit == 8  # (k - 1) blocks: the last token must be computed again
    assert [b.block_id for b in hits] == manager.get_block_ids("a")[:2]

    hits, num_hit = manager.get_computed_blocks(make_request("c", tokens + [99]))
    assert num_hit == 12
    assert [b.block_id for b in hits] == manager.get_block_ids("a")

    hits, num_hit = manager.get_computed_blocks(make_request("d", tokens[:3]))
    assert (hits, num_hit) == ([], 0)


def test_get_computed_blocks_stops_at_the_first_miss():
    manager = KVCacheManager(block_size=2, num_blocks=10, enable_caching=True)
    run_prefill(manager, make_request("a", [1, 2, 3, 4, 5, 6], block_size=2))
    hits, num_hit = manager.get_computed_blocks(make_request("b", [1, 2, 0, 0, 5, 6, 7], 2))
    assert num_hit == 2 and len(hits) == 1
    # Same later blocks after a different first block: chained hashes do not match.
    c = make_request("c", [9, 9, 3, 4, 5, 6, 7], 2)
    assert manager.get_computed_blocks(c) == ([], 0)
    assert manager.block_pool.get_cached_block(c.block_hashes[1]) is None
    assert manager.block_pool.get_cached_block(c.block_hashes[2]) is None


def test_cache_salt_isolates_prefix_cache_hits():
    manager = KVCacheManager(block_size=4, num_blocks=10, enable_caching=True)
    tokens = list(range(9))
    run_prefill(manager, make_request("a", tokens, cache_salt="alice"))
    assert manager.get_computed_blocks(make_request("b", tokens))[1] == 0
    assert manager.get_computed_blocks(make_request("c", tokens, cache_salt="bob"))[1] == 0
    assert manager.get_computed_blocks(make_request("d", tokens, cache_salt="alice"))[1] == 8


def test_no_prefix_hits_when_caching_is_disabled():
    manager = KVCacheManager(block_size=4, num_blocks=10, enable_caching=False)
    tokens = list(range(9))
    run_prefill(manager, make_request("a", tokens))
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert manager.get_computed_blocks(make_request("b", tokens)) == ([], 0)


def test_prefix_hits_are_shared_and_ref_counted():
    manager = KVCacheManager(block_size=4, num_blocks=10, enable_caching=True)
    tokens = list(range(10))
    a, b = make_request("a", tokens), make_request("b", tokens)
    run_prefill(manager, a)
    hits, num_hit = run_prefill(manager, b)
    assert num_hit == 8
    ids_a, ids_b = manager.get_block_ids("a"), manager.get_block_ids("b")
    assert ids_a[:2] == ids_b[:2]
    assert ids_a[2] != ids_b[2]  # the partial block is private
    assert [blk.ref_cnt for blk in hits] == [2, 2]
    free_before = manager.num_free_blocks
    manager.free(a)
    assert [blk.ref_cnt for blk in hits] == [1, 1]
    assert manager.num_free_blocks == free_before + 1
    manager.free(b)
    assert manager.num_free_blocks == 9
    check_pool(manager.block_pool)


def test_prefix_hit_on_freed_blocks_revives_them():
    manager = KVCacheManager(block_size=4, num_blocks=6, enable_caching=True)
    tokens = list(range(9))
    a = make_request("a", tokens)
    run_prefill(manager, a)
    manager.free(a)
    assert manager.num_free_blocks == 5
    b = make_request("b", tokens)
    hits, num_hit = run_prefill(manager, b)
    assert num_hit == 8
    assert all(blk.ref_cnt == 1 for blk in hits)
    assert not set(hits) & set(manager.block_pool.free_block_queue)
    assert manager.num_free_blocks == 2  # 2 revived + 1 new block
    check_pool(manager.block_pool)


def test_free_puts_the_request_tail_first_in_eviction_order():
    manager = KVCacheManager(block_size=2, num_blocks=4, enable_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5, 6], block_size=2)
    run_prefill(manager, a)
    ids = manager.get_block_ids("a")
    manager.free(a)
    assert "a" not in manager.req_to_blocks
    assert free_ids(manager.block_pool) == ids[::-1]
    # Evicting the tail first keeps the shared prefix findable the longest.
    manager.block_pool.get_new_blocks(1)
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7], block_size=2)
    assert manager.get_computed_blocks(b)[1] == 4


def test_allocate_slots_returns_none_and_changes_nothing_when_short():
    manager = KVCacheManager(block_size=4, num_blocks=4, enable_caching=True)
    big = make_request("big", list(range(13)))  # needs 4 blocks, 3 are free
    assert manager.allocate_slots(big, 13) is None
    assert manager.num_free_blocks == 3
    assert "big" not in manager.req_to_blocks
    assert "big" not in manager.num_cached_blocks
    assert manager.get_block_ids("big") == []
    check_pool(manager.block_pool)


def test_allocate_slots_failure_keeps_a_running_request_blocks():
    manager = KVCacheManager(block_size=4, num_blocks=3, enable_caching=True)
    req = make_request("r", list(range(8)))
    assert manager.allocate_slots(req, 8) is not None
    req.num_computed_tokens = 8
    ids = manager.get_block_ids("r")
    assert manager.allocate_slots(req, 1) is None
    assert manager.get_block_ids("r") == ids
    assert manager.num_free_blocks == 0
    check_pool(manager.block_pool)


def test_allocate_slots_counts_revived_hits_against_the_free_blocks():
    manager = KVCacheManager(block_size=4, num_blocks=4, enable_caching=True)
    tokens = list(range(9))
    a = make_request("a", tokens)
    run_prefill(manager, a)  # 3 blocks
    manager.free(a)  # all 3 free again, 2 of them hashed
    filler = make_request("filler", [50])
    assert manager.allocate_slots(filler, 1) is not None  # evicts the unhashed block
    b = make_request("b", tokens)
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8
    # The 2 hits sit in the free queue: taking them plus 1 new block needs 3 free blocks, 2 are.
    assert manager.allocate_slots(b, 1, num_hit, hits) is None
    assert all(blk.ref_cnt == 0 for blk in hits)
    assert set(hits) <= set(manager.block_pool.free_block_queue)
    assert manager.num_free_blocks == 2
    assert "b" not in manager.req_to_blocks
    check_pool(manager.block_pool)


def test_allocate_slots_rejects_non_positive_token_counts():
    manager = KVCacheManager(block_size=4, num_blocks=4, enable_caching=True)
    with pytest.raises(ValueError):
        manager.allocate_slots(make_request("r", [1]), 0)
    assert "r" not in manager.req_to_blocks


def test_allocate_slots_registers_only_full_blocks():
    manager = KVCacheManager(block_size=4, num_blocks=10, enable_caching=True)
    req = make_request("r", list(range(10)))
    manager.allocate_slots(req, 6)  # a chunk: 1 full block, 1 partial
    assert manager.num_cached_blocks["r"] == 1
    blocks = manager.req_to_blocks["r"]
    assert blocks[0].block_hash == req.block_hashes[0]
    assert blocks[1].block_hash is None
    req.num_computed_tokens = 6
    manager.allocate_slots(req, 4)
    assert manager.num_cached_blocks["r"] == 2
    assert blocks[1].block_hash == req.block_hashes[1]
    assert blocks[2].block_hash is None
    check_pool(manager.block_pool)


def test_manager_reset_prefix_cache():
    manager = KVCacheManager(block_size=4, num_blocks=6, enable_caching=True)
    tokens = list(range(9))
    a = make_request("a", tokens)
    run_prefill(manager, a)
    assert not manager.reset_prefix_cache()
    manager.free(a)
    assert manager.reset_prefix_cache()
    assert manager.get_computed_blocks(make_request("b", tokens)) == ([], 0)


def test_prefix_cache_stats_count_queries_and_hits():
    manager = KVCacheManager(block_size=4, num_blocks=10, enable_caching=True)
    tokens = list(range(9))
    run_prefill(manager, make_request("a", tokens))
    manager.get_computed_blocks(make_request("b", tokens))
    stats = manager.prefix_cache_stats
    assert stats.queries == 18
    assert stats.hits == 8
    assert stats.hit_rate == pytest.approx(8 / 18)
