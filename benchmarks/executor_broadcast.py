"""Per-step cost of reaching the workers through `MultiprocExecutor` (ZMQ IPC, msgspec) against
the in-process `UniProcExecutor`, at N decoding requests on a small model (CPU).

Runs the same greedy workload (N requests, every one decoding ``--max-tokens`` tokens) through
each executor and reports wall time per engine step; the difference to ``uni`` is what the
broadcast, the reply and the extra ranks' work add. Also times encoding and decoding one N-request
decode step's `SchedulerOutput` on its own. Prints one JSON object.

    python benchmarks/executor_broadcast.py --model DIR --num-requests 256 --tp 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from pagellm import LLM, SamplingParams
from pagellm.executor import wire
from pagellm.scheduler.output import CachedRequestData, SchedulerOutput


def _run(model: str, n: int, max_tokens: int, **kwargs: object) -> dict[str, float]:
    llm = LLM(model, max_model_len=256, kv_cache_memory=256 << 20, max_num_seqs=n, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [[5 + i % 50, 6, 7, 8] for i in range(n)]
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm
    core = llm.llm_engine.engine_core
    steps = core.num_steps
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    steps = core.num_steps - steps
    core.shutdown()
    return {"steps": steps, "ms_per_step": 1e3 * elapsed / steps}


def _codec(n: int, repeat: int = 200) -> dict[str, float]:
    ids = [f"req-{i}" for i in range(n)]
    out = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=ids,
            resumed_from_preemption=[False] * n,
            new_block_ids=[[i] if i % 16 == 0 else [] for i in range(n)],
            num_computed_tokens=[100 + i for i in range(n)],
        ),
        num_scheduled_tokens=dict.fromkeys(ids, 1),
        total_num_scheduled_tokens=n,
        preempted_req_ids=set(),
        finished_req_ids=set(),
    )
    msg = wire.ExecuteModel(1, out)
    start = time.perf_counter()
    for _ in range(repeat):
        frame = wire.encoder.encode(msg)
    encode = (time.perf_counter() - start) / repeat
    start = time.perf_counter()
    for _ in range(repeat):
        wire.driver_decoder.decode(frame)
    decode = (time.perf_counter() - start) / repeat
    return {"frame_bytes": len(frame), "encode_us": 1e6 * encode, "decode_us": 1e6 * decode}


def measure(model: str, n: int, tokens: int, tp: int) -> dict[str, object]:
    """uni, mp at TP 1 and mp at TP ``tp`` on the same workload, and the codec alone."""
    runs = {
        "uni": _run(model, n, tokens),
        "mp_tp1": _run(model, n, tokens, distributed_executor_backend="mp"),
        f"mp_tp{tp}": _run(model, n, tokens, tensor_parallel_size=tp),
    }
    uni = runs["uni"]["ms_per_step"]
    for run in runs.values():
        run["overhead_ms_per_step"] = run["ms_per_step"] - uni
    return {
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
        "workload": f"{n} requests, 4-token prompts, {tokens} greedy tokens each",
        "runs": runs,
        "scheduler_output_codec": _codec(n),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    record = measure(args.model, args.num_requests, args.max_tokens, args.tp)
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
