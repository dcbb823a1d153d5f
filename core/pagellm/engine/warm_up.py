"""The start-up warm-up, for platforms whose kernels are compiled on first use
(`Platform.needs_warm_up`): the compiling happens now, not inside the first users' time to first
token."""

from __future__ import annotations

import logging
import time

from pagellm.config import EngineConfig
from pagellm.executor.abstract import Executor
from pagellm.kv_cache.manager import KVCacheManager
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams
from pagellm.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


def warm_up(config: EngineConfig, executor: Executor, num_blocks: int) -> None:
    """Short greedy requests through a throwaway scheduler and KV cache, before the engine takes
    any. Kernels specialize on batch shapes (Triton picks tile sizes from the longest query), so
    this covers prefills of every power-of-two length up to 1024 (capped by the model length and
    the token budget), alone and mixed with a batch of decodes, and decode batches (CUDA graph
    replay). The workers forget every warm-up request at the end. First, every row count the
    logits matmul can see (`Worker.warm_up_logits`)."""
    logits_seconds = max(executor.collective_rpc("warm_up_logits"))
    block_size = config.cache.block_size
    scheduler = Scheduler(config.scheduler, KVCacheManager(block_size, num_blocks, False))
    vocab = config.model.vocab_size
    cap = max(1, min(1024, config.model.max_model_len - 3, config.scheduler.max_num_batched_tokens))
    lengths = [1 << k for k in range(11) if 1 << k <= cap]
    num_decodes = max(0, min(16, config.scheduler.max_num_seqs - 1))
    index = 0

    def add(prompt_len: int, max_tokens: int) -> None:
        nonlocal index
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
        )
        ids = [(7 * i + index) % vocab for i in range(prompt_len)]
        scheduler.add_request(Request(f"_warmup-{index}", ids, params, None))
        index += 1

    def step() -> None:
        out = scheduler.schedule()
        scheduler.update_from_output(executor.execute_model(out))

    started = time.perf_counter()
    for length in lengths:  # prefills alone, one length per step
        add(length, 1)
        while scheduler.has_unfinished_requests():
            step()
    for _ in range(num_decodes):  # requests that decode while the prefills come in
        add(min(8, cap), len(lengths) + 3)
    step()
    for length in lengths:
        add(length, 1)
        step()
    while scheduler.has_unfinished_requests():
        step()
    out = scheduler.schedule()  # nothing left to run: tells the workers to drop the requests
    executor.execute_model(out)
    logger.info(
        "Warmed up in %.2f s (%d requests; before them, the logits at 1 to %d rows in %.2f s)",
        time.perf_counter() - started,
        index,
        config.scheduler.max_num_seqs,
        logits_seconds,
    )
