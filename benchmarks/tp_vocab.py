"""Per-step cost of the vocabulary layers under tensor parallelism, replicated (what pagellm
builds: every rank holds the whole embedding and LM head) against vocab-parallel (each rank holds
vocab / tp rows: a masked lookup plus an all-reduce of the embeddings, and an all-gather of the
logits), on two gloo ranks of this CPU.

Times one step's embedding lookup and LM head for ``--tokens`` tokens with SmolLM2-135M's shapes
(vocab 49152, hidden 576) in float32, and prints one JSON object: median milliseconds per step of
each layer and variant, on rank 0.

    python benchmarks/tp_vocab.py --tokens 1 256 --steps 50
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import time
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from pagellm.distributed import destroy_distributed, init_distributed

VOCAB, HIDDEN, TP = 49152, 576, 2


def _median_ms(fn: Any, steps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _rank(rank: int, port: int, tokens: list[int], steps: int, results: dict) -> None:
    torch.set_num_threads(1)
    group = init_distributed(
        world_size=TP,
        rank=rank,
        tensor_parallel_size=TP,
        init_method=f"tcp://127.0.0.1:{port}",
        backend="gloo",
    )
    torch.manual_seed(0)
    table = torch.randn(VOCAB, HIDDEN)
    rows = VOCAB // TP
    start, part = rank * rows, table[rank * rows : (rank + 1) * rows].contiguous()
    runs = []
    for n in tokens:
        ids = torch.randint(0, VOCAB, (n,))
        hidden = torch.randn(n, HIDDEN)

        def parallel_embedding(ids: torch.Tensor = ids) -> torch.Tensor:
            local = ids - start
            outside = (local < 0) | (local >= rows)
            out = F.embedding(local.masked_fill(outside, 0), part)
            return group.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))

        def parallel_lm_head(hidden: torch.Tensor = hidden) -> torch.Tensor:
            return group.all_gather(hidden @ part.t(), dim=-1)

        def replicated_embedding(ids: torch.Tensor = ids) -> torch.Tensor:
            return F.embedding(ids, table)

        def replicated_lm_head(hidden: torch.Tensor = hidden) -> torch.Tensor:
            return hidden @ table.t()

        runs.append(
            {
                "tokens": n,
                "embedding_replicated_ms": _median_ms(replicated_embedding, steps),
                "embedding_vocab_parallel_ms": _median_ms(parallel_embedding, steps),
                "lm_head_replicated_ms": _median_ms(replicated_lm_head, steps),
                "lm_head_vocab_parallel_ms": _median_ms(parallel_lm_head, steps),
            }
        )
    destroy_distributed()
    if rank == 0:
        results[0] = runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(port, args.tokens, args.steps, results), nprocs=TP, join=True)
        runs = results[0]
    machine = f"{platform.machine()} CPU, {os.cpu_count()} cores, one thread per rank"
    workload = f"vocab {VOCAB}, hidden {HIDDEN}, float32, tp {TP} (gloo)"
    print(json.dumps({"machine": machine, "workload": workload, "runs": runs}))


if __name__ == "__main__":
    main()
