"""Per-request KV block bookkeeping on top of the `BlockPool`: prefix lookups, allocation, freeing."""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagellm.kv_cache.residency import KVBlockResidency
from pagellm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    queries: int = 0
    """Prompt tokens looked up."""
    hits: int = 0
    """Tokens found in the cache."""

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        enable_caching: bool,
        residency: KVBlockResidency | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, residency)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        # Per request, the most tokens its blocks hold before it needs another block or fills one
        # (which prefix caching must register): below that, an allocation has nothing to do.
        self.room: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks that prefixes the request, and its token count.

        The hit is capped at ``num_tokens - 1`` so the step still computes at least one token
        (the logits of the last token are needed to sample).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt position computed
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of the request.

        ``new_computed_blocks`` are prefix-cache hits (covering ``num_new_computed_tokens``) taken
        at this allocation. Returns the newly allocated blocks, or None (and changes nothing) when
        the pool cannot hold them.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}.")
        if (
            new_computed_blocks is None
            and request.num_computed_tokens + num_new_tokens <= self.room.get(request.request_id, 0)
        ):
            return []  # most decode steps: the last block has room and fills no block
        computed_blocks = new_computed_blocks or []
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(num_required - len(req_blocks) - len(computed_blocks), 0)
        # Hits sitting in the free queue stop being free once touched.
        num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_revived > self.block_pool.get_num_free_blocks():
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None

        self.block_pool.touch(computed_blocks)
        req_blocks.extend(computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)

        if self.enable_caching:
            num_full = min(
                (num_computed + num_new_tokens) // self.block_size, len(request.block_hashes)
            )
            num_cached = self.num_cached_blocks.get(request.request_id, 0)
            if num_full > num_cached:
                self.block_pool.cache_full_blocks(
                    req_blocks, request.block_hashes, num_cached, num_full
                )
                self.num_cached_blocks[request.request_id] = num_full
            next_full = (self.num_cached_blocks.get(request.request_id, 0) + 1) * self.block_size
            self.room[request.request_id] = min(len(req_blocks) * self.block_size, next_full - 1)
        else:
            self.room[request.request_id] = len(req_blocks) * self.block_size
        return new_blocks

    def free(self, request: Request, num_valid_tokens: int | None = None) -> None:
        """Release every block of the request; the tail blocks are the first to be evicted.

        ``num_valid_tokens``: only this many tokens' K/V were really computed (a request preempted
        in the step that scheduled it): blocks it registered beyond them leave the prefix cache.
        """
        blocks = self.req_to_blocks.pop(request.request_id, [])
        if num_valid_tokens is not None:
            for block in blocks[num_valid_tokens // self.block_size :]:
                if block.block_hash is not None and block.ref_cnt == 1:
                    self.block_pool.uncache(block)
        self.num_cached_blocks.pop(request.request_id, None)
        self.room.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
