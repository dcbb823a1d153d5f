"""Where the GPU waits between steps: a timeline of consecutive engine steps, run back to back as
`pagellm bench throughput` runs them (no synchronisation between steps, so asynchronous
scheduling overlaps them as it would), recorded with torch.profiler (host and device).

Prints one JSON object: over the recorded window, the device's busy and idle time per step, the
longest idle gaps with the kernels around them and the host ranges running while the device
waited, the host time per step in each engine stage (schedule, launch, collect, ...), and the
CUDA runtime calls where the host blocked (synchronisations, pageable copies).

    python benchmarks/step_timeline.py --model benchmarks/configs/llama-3.1-8b --load-format dummy \
        --dtype bfloat16 --skip-tokenizer-init --num-prompts 200 --input-len 512 --output-len 512 \
        --skip-steps 60 --timeline-steps 20
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from pagellm.benchmarks import datasets, throughput

# Host ranges recorded around engine methods: (label, object path from the engine core, method).
RANGES = [
    ("schedule", "scheduler", "schedule"),
    ("update_from_output", "scheduler", "update_from_output"),
    ("launch", "executor.worker.model_runner", "launch"),
    ("collect", "executor.worker.model_runner", "collect"),
    ("prepare_inputs", "executor.worker.model_runner", "_prepare_inputs"),
    ("forward", "executor.worker.model_runner", "_forward"),
    ("sample", "executor.worker.model_runner", "_sample"),
    ("update_states", "executor.worker.model_runner", "_update_states"),
]
BLOCKING = ("Synchronize", "cudaMemcpy", "cudaStreamWaitEvent", "cudaHostAlloc", "cudaMalloc")


def wrap_ranges(core: Any) -> None:
    for label, path, name in RANGES:
        owner = functools.reduce(getattr, path.split("."), core)
        method = getattr(owner, name)

        def wrapped(*args: Any, __m: Any = method, __label: str = label, **kwargs: Any) -> Any:
            with record_function(f"pagellm::{__label}"):
                return __m(*args, **kwargs)

        setattr(owner, name, wrapped)


def analyse(prof: Any, num_steps: int, top: int) -> dict[str, Any]:
    kernels: list[tuple[float, float, str]] = []
    host: list[tuple[float, float, str]] = []
    runtime: collections.Counter[str] = collections.Counter()
    runtime_calls: collections.Counter[str] = collections.Counter()
    for ev in prof.events():
        start, end = ev.time_range.start, ev.time_range.end
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append((start, end, ev.name))
        elif ev.name.startswith("pagellm::"):
            host.append((start, end, ev.name.removeprefix("pagellm::")))
        elif ev.name.startswith("cuda") and any(b in ev.name for b in BLOCKING):
            runtime[ev.name] += end - start
            runtime_calls[ev.name] += 1
    kernels.sort()
    if not kernels:
        raise SystemExit("No device kernels were recorded (this tool needs a GPU).")
    busy, gaps = 0.0, []
    cur_start, cur_end, last_name = kernels[0][0], kernels[0][1], kernels[0][2]
    for start, end, name in kernels[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append((start - cur_end, cur_end, start, last_name, name))
            cur_start = start
        if end >= cur_end:
            cur_end, last_name = end, name
    busy += cur_end - cur_start
    span = cur_end - kernels[0][0]
    idle = span - busy

    def during(a: float, b: float) -> dict[str, float]:
        out: collections.Counter[str] = collections.Counter()
        for s, e, label in host:
            overlap = min(b, e) - max(a, s)
            if overlap > 0:
                out[label] += overlap
        return {k: round(v, 1) for k, v in out.most_common()}

    host_totals: collections.Counter[str] = collections.Counter()
    for s, e, label in host:
        host_totals[label] += e - s
    gaps.sort(reverse=True)
    idle_by_cause: collections.Counter[str] = collections.Counter()
    for g in gaps:
        cause = during(g[1], g[2])
        idle_by_cause[next(iter(cause), "no pagellm range")] += g[0]
    return {
        "steps": num_steps,
        "device_span_ms_per_step": round(span / num_steps / 1e3, 3),
        "device_busy_ms_per_step": round(busy / num_steps / 1e3, 3),
        "device_idle_ms_per_step": round(idle / num_steps / 1e3, 3),
        "busy_fraction": round(busy / span, 3),
        "gaps_over_20us_per_step": round(sum(1 for g in gaps if g[0] > 20) / num_steps, 1),
        "idle_ms_per_step_by_host_range": {
            k: round(v / num_steps / 1e3, 3) for k, v in idle_by_cause.most_common()
        },
        "longest_gaps": [
            {
                "us": round(g[0], 1),
                "after": g[3][:80],
                "before": g[4][:80],
                "host_ranges_us": during(g[1], g[2]),
            }
            for g in gaps[:top]
        ],
        "host_ms_per_step": {
            k: round(v / num_steps / 1e3, 3) for k, v in host_totals.most_common()
        },
        "blocking_runtime_ms_per_step": {
            k: {
                "ms": round(v / num_steps / 1e3, 3),
                "calls": round(runtime_calls[k] / num_steps, 1),
            }
            for k, v in runtime.most_common()
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    throughput.add_args(parser)
    parser.add_argument("--skip-steps", type=int, default=60, help="steps run before recording")
    parser.add_argument("--timeline-steps", type=int, default=20, help="steps recorded")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()

    from pagellm import LLM, SamplingParams
    from pagellm.engine.args import EngineArgs
    from pagellm.sampling_params import RequestOutputKind

    if args.max_model_len is None:
        (_, longest_in), (_, longest_out) = datasets.length_ranges(args)
        args.max_model_len = longest_in + longest_out + 1
    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    engine = llm.llm_engine
    core = engine.engine_core
    requests = datasets.requests_from_args(args, engine.config.model.vocab_size, set())
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=r.output_len,
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        for r in requests
    ]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    wrap_ranges(core)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"timeline-{i}", prompt, p)
    for _ in range(args.skip_steps):
        engine.step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    tokens = []
    with profile(activities=acts) as prof:
        for _ in range(args.timeline_steps):
            engine.step()
            tokens.append(core.make_scheduler_stats().num_scheduled_tokens)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    out = {
        "attention_backend": engine.config.attention_backend,
        "async_scheduling": engine.config.scheduler.async_scheduling,
        "tokens_per_step": tokens,
        **analyse(prof, args.timeline_steps, args.top),
    }
    while engine.has_unfinished_requests():
        engine.step()
    core.shutdown()
    text = json.dumps(out, indent=1)
    print(text)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
