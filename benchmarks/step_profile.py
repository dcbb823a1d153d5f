"""Where a workload's step time goes on the GPU: wall time per step against the time the GPU
spent in kernels, and the kernels that took it, grouped by family.

Runs the engine in process on random prompts (the `pagellm bench throughput` flags), times every
step, and records every other step of a window with torch.profiler (CUDA activity; the steps in
between run without it, for wall times the profiler does not inflate). Prints one JSON object:
per phase (prefill steps, decode-only steps) the mean wall time, the mean kernel time, the host
time of the model's eager forward pass (its launches), and the top kernels by total time.

    python benchmarks/step_profile.py --model benchmarks/configs/qwen3-0.6b --load-format dummy \
        --dtype bfloat16 --skip-tokenizer-init --num-prompts 64 --input-len 2048 --output-len 16
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from pagellm.benchmarks import datasets, throughput

# Kernel-name patterns, first match wins: what each family of kernels is for.
FAMILIES = [
    (
        "attention",
        r"attn|attention|flash|fmha|paged|decode_kernel|prefill_kernel|BatchPrefill|BatchDecode",
    ),
    # pagellm-fp8's norms and SiLU-and-mul that write fp8 (`kernels/fused_input.py`), then its
    # activation quantization kernels (row maxima, amax, quantization).
    ("norm/act + quant", r"rms_norm_quant|silu_and_mul_quant"),
    ("act quantization", r"quant|amax"),
    ("gemm", r"gemm|matmul|cutlass|sm90_xmma|nvjet|cublas|_mm_|splitK"),
    ("kv write", r"reshape_and_cache|kv_write|store_kv|write_kv|_cache_kernel"),
    ("norm", r"rms|norm"),
    ("rope", r"rope|rotary"),
    ("activation", r"silu|gelu|act_and_mul|swiglu"),
    ("sampling", r"sort|topk|softmax|argmax|multinomial|exponential|gumbel|cumsum"),
    ("copy / index", r"copy|index|gather|scatter|cat|fill|elementwise|vectorized|reduce|unrolled"),
]


def family(name: str) -> str:
    for fam, pattern in FAMILIES:
        if re.search(pattern, name, re.IGNORECASE):
            return fam
    return "other"


def mean_of(steps: list[dict[str, Any]], key: str) -> float | None:
    values = [s[key] for s in steps if s[key] is not None]
    return round(sum(values) / len(values), 3) if values else None


def phase_of(step: dict[str, Any]) -> str:
    return "decode" if step["tokens"] == step["reqs"] else "prefill/mixed"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    throughput.add_args(parser)
    parser.add_argument(
        "--profile-steps", type=int, default=12, help="steps recorded (first N after warm-up)"
    )
    parser.add_argument("--skip-steps", type=int, default=2, help="steps run before recording")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()

    from pagellm import LLM, SamplingParams
    from pagellm.engine.args import EngineArgs
    from pagellm.sampling_params import RequestOutputKind

    if args.model is None:
        from pagellm.model_loader import default_model_path

        args.model = default_model_path()
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
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"prof-{i}", prompt, p)

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    steps: list[dict[str, Any]] = []

    # The host time of the model's eager forward pass (its kernel launches; the GPU runs them
    # behind it): a step whose forward takes about as long as its kernels is bound by the host.
    model = core.executor.worker.model_runner.model
    eager_forward = model.forward
    forward_ms: list[float] = []

    def timed_forward(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        result = eager_forward(*args, **kwargs)
        forward_ms.append((time.perf_counter() - t0) * 1e3)
        return result

    model.forward = timed_forward

    def one_step() -> None:
        sync()
        forward_ms.clear()
        t0 = time.perf_counter()
        engine.step()
        sync()
        stats = core.make_scheduler_stats()
        steps.append(
            {
                "wall_ms": (time.perf_counter() - t0) * 1e3,
                "forward_host_ms": sum(forward_ms) if forward_ms else None,  # None: a graph ran
                "tokens": stats.num_scheduled_tokens,
                "reqs": stats.num_scheduled_reqs,
            }
        )

    for _ in range(args.skip_steps):
        one_step()
    # Record a window of steps, one profiler per step so that each step's kernels are its own;
    # every other step of the window runs without the profiler, for its true wall time.
    phases: dict[str, dict[str, Any]] = {}
    unprofiled: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    while engine.has_unfinished_requests():
        index = len(steps) - args.skip_steps
        if index >= args.profile_steps or index % 2:
            one_step()
            if index < args.profile_steps:
                unprofiled[phase_of(steps[-1])].append(steps[-1])
            continue
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            one_step()
        step = steps[-1]
        phase = phase_of(step)
        agg = phases.setdefault(
            phase,
            {
                "steps": 0,
                "wall_ms": 0.0,
                "tokens": 0,
                "kernel_ms": 0.0,
                "kernels": collections.Counter(),
                "families": collections.Counter(),
                "launches": 0,
            },
        )
        agg["steps"] += 1
        agg["wall_ms"] += step["wall_ms"]
        agg["tokens"] += step["tokens"]
        for ev in prof.events():
            if cuda and ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = ev.device_time if hasattr(ev, "device_time") else ev.cuda_time
            agg["kernel_ms"] += us / 1e3
            agg["launches"] += 1
            agg["kernels"][ev.name[:110]] += us / 1e3
            agg["families"][family(ev.name)] += us / 1e3
    out: dict[str, Any] = {"attention_backend": engine.config.attention_backend, "phases": {}}
    for phase, agg in phases.items():
        n = agg["steps"]
        out["phases"][phase] = {
            "steps": n,
            "tokens_per_step": round(agg["tokens"] / n, 1),
            "wall_ms_per_step": round(agg["wall_ms"] / n, 3),
            "wall_ms_per_step_unprofiled": mean_of(unprofiled[phase], "wall_ms"),
            "forward_host_ms_per_step_unprofiled": mean_of(unprofiled[phase], "forward_host_ms"),
            "kernel_ms_per_step": round(agg["kernel_ms"] / n, 3),
            "kernels_per_step": round(agg["launches"] / n, 1),
            "gpu_busy_fraction": round(agg["kernel_ms"] / agg["wall_ms"], 3),
            "families_ms_per_step": {k: round(v / n, 3) for k, v in agg["families"].most_common()},
            "top_kernels_ms_per_step": {
                k: round(v / n, 3) for k, v in agg["kernels"].most_common(args.top)
            },
        }
    walls = [s["wall_ms"] for s in steps]
    out["all_steps"] = {"steps": len(steps), "wall_s": round(sum(walls) / 1e3, 3)}
    core.shutdown()
    text = json.dumps(out, indent=1)
    print(text)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
