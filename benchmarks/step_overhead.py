"""Per-step CPU cost of the engine around the model: scheduling, input preparation, sampling
bookkeeping and output processing (detokenization included), at N running requests.

The model is a stub that does no arithmetic worth timing (it emits a fixed, position-dependent
token), so what is left is the host-side work every step pays whatever the GPU does. Prints one
JSON object with a run per size: mean and p50/p99 per step of each stage and of the whole step, in
milliseconds, for the steps with every request decoding and, apart, for the drain (the last steps,
in which the requests finish and their outputs are built).

    python benchmarks/step_overhead.py --num-requests 256 512 1024 --steps 200 [--profile s.prof]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import platform
import statistics
import tempfile
import time
from typing import Any

import torch
from torch import nn

STUB_ARCH = "PagellmStubForCausalLM"
STUB_VOCAB = 1024


class StubForCausalLM(nn.Module):
    """No arithmetic worth timing: the hidden state is the position, and the logits are a fixed
    table (built once) whose rows peak at different real text tokens."""

    def __init__(self, config: Any, attn_backend: Any, quant_config: Any = None) -> None:
        super().__init__()
        vocab = config.model.vocab_size
        rows = max(config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens)
        peaks = (torch.arange(rows) * 7919) % (vocab - 300) + 300
        self.logits: torch.Tensor
        self.register_buffer(
            "logits", torch.nn.functional.one_hot(peaks, vocab).float(), persistent=False
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return positions.unsqueeze(1).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits[: hidden.shape[0]]

    def load_weights(self, weights: Any) -> set[str]:
        return set()


def make_stub_model_dir(directory: str, tokenizer_dir: str | None) -> str:
    """A small config (with the stub's architecture) and a real tokenizer (default: SmolLM2's)."""
    from transformers import AutoConfig, AutoTokenizer

    from pagellm.model_loader import default_model_path
    from pagellm.model_loader.source import resolve_model_source

    tokenizer_dir = tokenizer_dir or resolve_model_source(default_model_path()).hf_directory()
    config = AutoConfig.for_model(
        "llama",
        vocab_size=STUB_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        architectures=[STUB_ARCH],
    )
    config.save_pretrained(directory)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(directory)
    return directory


def _stats(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1e3 for s in samples)
    return {
        "mean_ms": round(statistics.fmean(ms), 4),
        "p50_ms": round(ms[len(ms) // 2], 4),
        "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 4),
    }


class GCClock:
    """The garbage collector's pauses while ``on``: a full collection walks every tracked object
    (each KV block, each token list), so it shows up as a slow step."""

    def __init__(self) -> None:
        self.on = False
        self.pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if not self.on:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses[info["generation"]].append(time.perf_counter() - self._start)

    def close(self) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, dict[str, float]]:
        return {
            f"gen{g}": {
                "collections": len(p),
                "total_ms": round(sum(p) * 1e3, 2),
                "max_ms": round(max(p, default=0.0) * 1e3, 2),
            }
            for g, p in self.pauses.items()
        }


class StepTimer:
    """One engine step split into its four stages, timed; samples kept per stage and whole, and
    the garbage collector's pauses within the recorded steps."""

    STAGES = ("schedule", "execute", "update", "output")

    def __init__(self, engine: Any) -> None:
        core = engine.engine_core
        self.scheduler, self.executor = core.scheduler, core.executor
        self.output_processor = engine.output_processor
        self.stages: dict[str, list[float]] = {name: [] for name in self.STAGES}
        self.totals: list[float] = []
        self.gc = GCClock()

    def step(self, record: bool) -> tuple[int, list[Any]]:
        """Run one step; returns how many requests it scheduled and its `RequestOutput`s."""
        clock = time.perf_counter
        self.gc.on = record
        t0 = clock()
        sched_out = self.scheduler.schedule()
        t1 = clock()
        runner_out = self.executor.execute_model(sched_out)
        t2 = clock()
        core_out = self.scheduler.update_from_output(runner_out)
        t3 = clock()
        outputs, _ = self.output_processor.process_outputs(core_out)
        t4 = clock()
        self.gc.on = False
        if record:
            for name, value in zip(self.STAGES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                self.stages[name].append(value)
            self.totals.append(t4 - t0)
        return len(sched_out.num_scheduled_tokens), outputs

    def summary(self) -> dict[str, Any]:
        self.gc.close()
        return {
            "stages": {name: _stats(values) for name, values in self.stages.items()},
            "step": _stats(self.totals),
            "gc_pauses": self.gc.summary(),
        }


def run_size(args: argparse.Namespace, n: int, profile_path: str | None) -> dict[str, Any]:
    """Build an engine for ``n`` running requests, time ``args.steps`` steps with all of them
    decoding, then the drain: the steps in which they finish and their outputs are built."""
    from pagellm import SamplingParams
    from pagellm.engine.args import EngineArgs
    from pagellm.engine.llm_engine import LLMEngine
    from pagellm.sampling_params import RequestOutputKind

    budget = max(8192, n)
    total_steps = args.warmup_steps + args.steps
    # Requests whose prefill ends early decode while the others prefill: room for those tokens.
    slack = 2 * -(-n * args.prompt_len // (budget - n // 2)) + 16
    max_tokens = total_steps + slack + args.drain_steps
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_stub_model_dir(os.path.join(tmp, "stub"), args.tokenizer)
        engine = LLMEngine.from_engine_args(
            EngineArgs(
                model=model_dir,
                load_format="dummy",
                max_num_seqs=n,
                max_num_batched_tokens=budget,
                max_model_len=args.prompt_len + max_tokens + 8,
                kv_cache_memory=1 << 30,
                attention_backend=args.attention_backend,
            )
        )
    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY
        if args.output_kind == "final"
        else RequestOutputKind.DELTA,
    )
    for i in range(n):
        prompt = [(i * 31 + j * 17) % (STUB_VOCAB - 300) + 300 for j in range(args.prompt_len)]
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)

    scheduler = engine.engine_core.scheduler
    # Prefill until every request is decoding.
    while len(scheduler.running) < n or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running
    ):
        engine.step()
    # Line up the ends: request j finishes in drain step j % drain_steps after the timed steps
    # (the scheduler alone decides a request's length; the front end only sees its finish).
    for j, request in enumerate(scheduler.running):
        request.max_tokens = len(request.output_token_ids) + total_steps + 1 + j % args.drain_steps

    timer, drain = StepTimer(engine), StepTimer(engine)
    profiler = cProfile.Profile() if profile_path else None
    for step in range(total_steps):
        if profiler is not None and step == args.warmup_steps:
            profiler.enable()
        num_scheduled, _ = timer.step(record=step >= args.warmup_steps)
        if num_scheduled != n:
            raise RuntimeError(
                f"{num_scheduled} of {n} requests ran in step {step} "
                f"({len(scheduler.running)} running, {len(scheduler.waiting)} waiting)."
            )
    finished = 0
    while scheduler.has_unfinished_requests():
        _, outputs = drain.step(record=True)
        finished += sum(1 for o in outputs if o.finished)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile_path)
    if finished != n or len(drain.totals) != args.drain_steps:
        raise RuntimeError(
            f"The drain finished {finished} of {n} requests in {len(drain.totals)} steps "
            f"(expected {args.drain_steps})."
        )
    return {
        "num_running_requests": n,
        **timer.summary(),
        "drain": {"steps": len(drain.totals), "finished_per_step": n / args.drain_steps}
        | drain.summary(),
        "attention_backend": engine.config.attention_backend,
    }


def _profile_path(base: str | None, n: int, several: bool) -> str | None:
    if base is None or not several:
        return base
    stem, ext = os.path.splitext(base)
    return f"{stem}_{n}{ext}"


def executor_runs(n: int, tp: int, tokenizer_dir: str | None) -> dict[str, object]:
    """``--tp``: what reaching the workers costs per step (uni, mp at TP 1, mp at TP ``tp``), on
    a tiny random Llama: spawned worker processes cannot load the stub, which is registered in
    this process only. The runs of `executor_broadcast.py`, the sibling script."""
    from executor_broadcast import measure
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pagellm.model_loader import default_model_path
    from pagellm.model_loader.source import resolve_model_source

    tokenizer_dir = tokenizer_dir or resolve_model_source(default_model_path()).hf_directory()
    config = LlamaConfig(
        vocab_size=STUB_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(tmp)
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp)
        return measure(tmp, n, 32, tp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--num-requests", type=int, nargs="+", default=[256], help="One run per size."
    )
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200, help="Timed decode steps.")
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument(
        "--drain-steps",
        type=int,
        default=4,
        help="The requests finish over this many steps after the timed ones (timed apart).",
    )
    parser.add_argument(
        "--attention-backend",
        default=None,
        help="Backend whose per-step metadata build is timed (default: the platform's choice; "
        "on a CPU, TRITON_ATTN needs TRITON_INTERPRET=1).",
    )
    parser.add_argument(
        "--output-kind",
        choices=["final", "delta"],
        default="final",
        help="final: outputs only when a request ends (what LLM.generate asks for); delta: a "
        "RequestOutput per request per step (what a streaming server asks for).",
    )
    parser.add_argument(
        "--tokenizer", default=None, help="Tokenizer directory (default: the packaged SmolLM2's)."
    )
    parser.add_argument("--output-json", default=None)
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="Above 1: also time reaching the workers at the first --num-requests (uni, mp at "
        "TP 1 and at TP N, on a tiny random Llama), as the result's 'executors'.",
    )
    parser.add_argument(
        "--profile",
        default=None,
        help="Write a cProfile of the timed and drain steps (not start-up) to this path "
        "(PATH_<n>.EXT per size when there are several).",
    )
    args = parser.parse_args()

    from pagellm.models.registry import register_model

    register_model(STUB_ARCH, f"{__name__}:StubForCausalLM")
    several = len(args.num_requests) > 1
    runs = [run_size(args, n, _profile_path(args.profile, n, several)) for n in args.num_requests]
    result = {
        "benchmark": "step_overhead",
        "prompt_len": args.prompt_len,
        "output_kind": args.output_kind,
        "detokenize": True,
        "timed_steps": args.steps,
        "runs": runs,
        "note": "execute = model runner with a stub model: state update, input preparation, the "
        "stub's trivial forward, sampling on [N, 1024] logits, output bookkeeping; drain = the "
        "steps after the timed ones in which the requests finish and their outputs are built",
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
    }
    if args.tp > 1:
        result["executors"] = executor_runs(args.num_requests[0], args.tp, args.tokenizer)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
