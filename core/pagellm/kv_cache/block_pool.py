"""The pool of KV cache blocks: a doubly linked free queue, reference counts and the prefix-cache map.

Free blocks with a hash stay findable by prefix lookups until evicted; the queue is the eviction
order (head first). Unhashed blocks are freed to the head (nothing to keep), hashed ones to the
tail (least recently used goes first). Block 0 is the null block, never handed out: block tables
are padded with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from pagellm.kv_cache.residency import KVBlockResidency


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) removal from the middle (a prefix hit revives one)."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.extend(list(blocks))

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("No free KV cache block is left.")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue.")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def _insert_after(self, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
        nxt = anchor.next_free
        assert nxt is not None
        block.prev_free, block.next_free = anchor, nxt
        anchor.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        prev = self._tail.prev_free
        assert prev is not None
        self._insert_after(prev, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def extend(self, blocks: list[KVCacheBlock]) -> None:
        """``append`` each block, in order (one pass: a request's blocks are freed together)."""
        prev = self._tail.prev_free
        assert prev is not None
        for block in blocks:
            block.prev_free, prev.next_free = prev, block
            prev = block
        prev.next_free, self._tail.prev_free = self._tail, prev
        self.num_free_blocks += len(blocks)

    def extendleft(self, blocks: list[KVCacheBlock]) -> None:
        """``appendleft`` each block, in order: the last one ends up first."""
        nxt = self._head.next_free
        assert nxt is not None
        for block in blocks:
            block.next_free, nxt.prev_free = nxt, block
            nxt = block
        nxt.prev_free, self._head.next_free = self._head, nxt
        self.num_free_blocks += len(blocks)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int, residency: KVBlockResidency | None = None) -> None:
        """``residency``: follows sampled blocks for the residency metrics (None: off)."""
        if num_blocks < 2:
            raise ValueError(
                f"The KV cache needs at least 2 blocks (one is the null block), got {num_blocks}."
            )
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self.residency = residency

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        usable = self.num_blocks - 1
        return 1.0 - self.get_num_free_blocks() / usable

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool.")
        blocks = []
        residency = self.residency
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if residency is not None:
                residency.reallocated(block.block_id, block.block_hash is not None)
            self.uncache(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def uncache(self, block: KVCacheBlock) -> None:
        """Forget a block's hash: it is reused for other tokens, or its contents will never be
        computed (its request was preempted in the step that registered it)."""
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, reviving those that sat in the free queue."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1
            if self.residency is not None:
                self.residency.hit(block.block_id)

    def cache_full_blocks(
        self, blocks: list[KVCacheBlock], block_hashes: list[bytes], num_cached: int, num_full: int
    ) -> None:
        """Register blocks[num_cached:num_full] under their hashes so later requests can share them."""
        for i in range(num_cached, num_full):
            block = blocks[i]
            if block.block_hash is not None:
                continue  # a prefix hit: already registered
            block_hash = block_hashes[i]
            if block_hash in self.cached_block_hash_to_block:
                continue  # another request computed the same block concurrently; keep that one
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero go back to the free queue,
        in the given order (the first freed is the first evicted among the hashed ones)."""
        unhashed: list[KVCacheBlock] = []
        hashed: list[KVCacheBlock] = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"Double free of {block}.")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (unhashed if block.block_hash is None else hashed).append(block)
        # The two ends of the queue do not meet: queueing each end's blocks at once gives the
        # order that queueing them one by one would.
        self.free_block_queue.extendleft(unhashed)
        self.free_block_queue.extend(hashed)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.residency is not None:
            self.residency.reset()
        return True
