"""What one tensor-parallel all-reduce costs at the sizes a TP = 2 engine sends, per kind:
``dist`` (torch.distributed over NCCL, what pagellm runs) and ``symm_mem`` (torch's symmetric-memory
one-shot and two-shot all-reduces over peer memory, multicast off), eagerly and replayed from a
CUDA graph of 20 calls (how decode steps run them).

Sizes: rows x hidden bf16, rows = 1 ... 8,192 (decode batches to a prefill chunk), hidden 4,096
(Llama-3.1-8B) by default. A W1 decode step at TP = 2 makes 64 of them (two per layer), so
their sum against the step's GEMM and attention time says how far TP = 2 can scale.

    python3 benchmarks/allreduce.py [--hidden 4096] [--rows 1 16 64 200 256 1024 8192]
        [--output-json F]

Two GPUs (NCCL); on a machine without them it runs the same on two gloo ranks on the CPU
(``dist`` over gloo, eagerly: a check of the script, not a figure). NVLink multicast stays
off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
CALLS = 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time_us(fn, device: torch.device, graph: bool) -> float:
    """Median µs of one call over 5 timings of ``CALLS`` calls (a graph of them, if ``graph``)."""
    if device.type != "cuda":
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(CALLS):
                fn()
            times.append((time.perf_counter() - start) / CALLS * 1e6)
        return sorted(times)[2]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(g, stream=stream):
            for _ in range(CALLS):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        run = g.replay
    times = []
    for _ in range(5):
        dist.barrier()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        if graph:
            run()
        else:
            for _ in range(CALLS):
                run()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / CALLS)
    return sorted(times)[2]


def _symm_mem_kinds(x_max: torch.Tensor, group_name: str) -> tuple[dict[str, Any], str | None]:
    """The symmetric-memory all-reduces as functions of a tensor, or why there are none."""
    if x_max.device.type != "cuda":
        return {}, "symmetric memory needs CUDA"
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(x_max.numel(), dtype=x_max.dtype, device=x_max.device)
        symm_mem.rendezvous(buffer, group_name)
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the other kinds still run
        return {}, f"{type(exc).__name__}: {exc}"
    ops = torch.ops.symm_mem

    def one_shot(x: torch.Tensor) -> None:
        view = buffer[: x.numel()]
        view.copy_(x.view(-1))
        ops.one_shot_all_reduce_out(view, "sum", group_name, x.view(-1))

    def two_shot(x: torch.Tensor) -> None:
        view = buffer[: x.numel()]
        view.copy_(x.view(-1))
        ops.two_shot_all_reduce_(view, "sum", group_name)
        x.view(-1).copy_(view)

    return {"symm_mem_one_shot": one_shot, "symm_mem_two_shot": two_shot}, None


def _rank(rank: int, port: int, args: argparse.Namespace, results: dict) -> None:
    os.environ.update(NO_MULTICAST)
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        world_size=2,
        rank=rank,
        **({"device_id": device} if cuda else {}),
    )
    dtype = torch.bfloat16 if cuda else torch.float32
    group_name = dist.group.WORLD.group_name
    x_max = torch.ones(max(args.rows), args.hidden, dtype=dtype, device=device)
    kinds = {"dist": lambda x: dist.all_reduce(x)}
    extra, symm_reason = _symm_mem_kinds(x_max, group_name)
    kinds.update(extra)
    rows = []
    for m in args.rows:
        x = torch.ones(m, args.hidden, dtype=dtype, device=device)
        entry: dict[str, Any] = {"rows": m, "bytes": x.numel() * x.element_size()}
        for name, fn in kinds.items():
            # Correct first: two ranks of ones sum to two (before the timed calls grow it).
            x.fill_(1.0)
            fn(x)
            if not bool((x == 2).all()):
                raise RuntimeError(f"{name} at {m} rows: the sum is not 2 everywhere")
            for graph in (False, True) if cuda else (False,):
                us = _time_us(lambda fn=fn, x=x: fn(x), device, graph)
                entry[f"{name}_{'graph' if graph else 'eager'}_us"] = round(us, 2)
        rows.append(entry)
        if rank == 0:
            print(json.dumps(entry), flush=True)
    if rank == 0:
        results["report"] = {
            "benchmark": "allreduce",
            "device": torch.cuda.get_device_name(0) if cuda else "cpu (gloo)",
            "world_size": 2,
            "dist_backend": dist.get_backend(),
            "dtype": str(dtype),
            "hidden": args.hidden,
            "calls_per_timing": CALLS,
            "symm_mem_unavailable": symm_reason,
            "rows": rows,
            "torch": torch.__version__,
        }
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 200, 256, 1024, 8192])
    parser.add_argument("--output-json")
    args = parser.parse_args()
    os.environ.update(NO_MULTICAST)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(_free_port(), args, results), nprocs=2, join=True)
        report = dict(results)["report"]
    print(json.dumps(report))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
