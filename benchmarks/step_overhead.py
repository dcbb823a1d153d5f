"""Per-step CPU cost of the engine around the model: scheduling, input preparation, sampling
bookkeeping and output processing (detokenization included), at N running requests.

The model is a stub that does no arithmetic worth timing (it emits a fixed, position-dependent
token), so what is left is the host-side work every step pays whatever the GPU does. Prints one
JSON object: mean and p50/p99 per step of each stage and of the whole step, in milliseconds.

    python benchmarks/step_overhead.py --num-requests 256 --steps 200 [--profile steps.prof]
"""

from __future__ import annotations

import argparse
import cProfile
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
# Requests whose prefill ends early decode while the others prefill: room for those tokens.
_PREFILL_SLACK = 64


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200, help="Timed decode steps.")
    parser.add_argument("--warmup-steps", type=int, default=20)
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
        "--profile",
        default=None,
        help="Write a cProfile of the timed steps (only they: not start-up) to this path.",
    )
    args = parser.parse_args()

    from pagellm import SamplingParams
    from pagellm.engine.args import EngineArgs
    from pagellm.engine.llm_engine import LLMEngine
    from pagellm.models.registry import register_model
    from pagellm.sampling_params import RequestOutputKind

    register_model(STUB_ARCH, f"{__name__}:StubForCausalLM")
    n = args.num_requests
    total_steps = args.warmup_steps + args.steps
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_stub_model_dir(os.path.join(tmp, "stub"), args.tokenizer)
        engine = LLMEngine.from_engine_args(
            EngineArgs(
                model=model_dir,
                load_format="dummy",
                max_num_seqs=n,
                max_num_batched_tokens=max(8192, n),
                max_model_len=args.prompt_len + total_steps + _PREFILL_SLACK + 8,
                kv_cache_memory=1 << 30,
                attention_backend=args.attention_backend,
            )
        )
    params = SamplingParams(
        temperature=0.0,
        max_tokens=total_steps + _PREFILL_SLACK,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY
        if args.output_kind == "final"
        else RequestOutputKind.DELTA,
    )
    for i in range(n):
        prompt = [(i * 31 + j * 17) % (STUB_VOCAB - 300) + 300 for j in range(args.prompt_len)]
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)

    core = engine.engine_core
    scheduler, executor = core.scheduler, core.executor
    # Prefill until every request is decoding.
    while len(scheduler.running) < n or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running
    ):
        engine.step()

    stages: dict[str, list[float]] = {"schedule": [], "execute": [], "update": [], "output": []}
    totals: list[float] = []
    clock = time.perf_counter
    profiler = cProfile.Profile() if args.profile else None
    for step in range(total_steps):
        if profiler is not None and step == args.warmup_steps:
            profiler.enable()
        t0 = clock()
        sched_out = scheduler.schedule()
        t1 = clock()
        runner_out = executor.execute_model(sched_out)
        t2 = clock()
        core_out = scheduler.update_from_output(runner_out)
        t3 = clock()
        engine.output_processor.process_outputs(core_out)
        t4 = clock()
        if len(sched_out.num_scheduled_tokens) != n:
            raise RuntimeError(
                f"{len(sched_out.num_scheduled_tokens)} of {n} requests ran in step {step} "
                f"({len(scheduler.running)} running, {len(scheduler.waiting)} waiting)."
            )
        if step >= args.warmup_steps:
            for name, value in zip(stages, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                stages[name].append(value)
            totals.append(t4 - t0)

    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)
    result = {
        "benchmark": "step_overhead",
        "num_running_requests": n,
        "prompt_len": args.prompt_len,
        "output_kind": args.output_kind,
        "detokenize": True,
        "timed_steps": args.steps,
        "stages": {name: _stats(values) for name, values in stages.items()},
        "step": _stats(totals),
        "attention_backend": engine.config.attention_backend,
        "note": "execute = model runner with a stub model: state update, input preparation, the "
        "stub's trivial forward, sampling on [N, 1024] logits, output bookkeeping",
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
