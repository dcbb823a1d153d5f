"""``pagellm bench throughput``: offline throughput on a random workload, optionally side by side
with Hugging Face transformers in the same process (``--backend hf``).

Every request generates exactly its output length (``ignore_eos``); throughput counts the tokens
requested, so a peer that pads or overruns pays for the waste.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import logging
import os
import platform
import time
from typing import Any

import numpy as np
import torch

from pagellm.benchmarks import datasets

# A name of this module: the vLLM peer harness wraps it to record the requests it gives vLLM.
from pagellm.benchmarks.datasets import requests_from_args


def add_args(parser: argparse.ArgumentParser) -> None:
    from pagellm.engine.args import EngineArgs

    parser.add_argument(
        "--model", default=None, help="Model directory or GGUF (default: the packaged SmolLM2)."
    )
    parser.add_argument(
        "--backend",
        choices=["pagellm", "hf"],
        default="pagellm",
        help="pagellm alone, or hf: pagellm then transformers on the same requests, with the ratio.",
    )
    parser.add_argument(
        "--hf-mode",
        choices=["generate", "continuous"],
        default="generate",
        help="transformers' padded-batch generate, or its continuous batching.",
    )
    parser.add_argument("--hf-max-batch-size", type=int, default=64)
    parser.add_argument(
        "--hf-attn-implementation",
        default=None,
        help="attn_implementation for transformers (continuous default: paged|sdpa).",
    )
    datasets.add_dataset_args(parser)
    EngineArgs.add_cli_args(parser)


def _summary(name: str, requests: list[datasets.BenchRequest], elapsed: float) -> dict[str, Any]:
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    output_tokens = sum(r.output_len for r in requests)
    return {
        "backend": name,
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(len(requests) / elapsed, 3),
        "total_tokens_per_s": round((prompt_tokens + output_tokens) / elapsed, 2),
        "output_tokens_per_s": round(output_tokens / elapsed, 2),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
    }


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device memory bandwidth in bytes/s, counting bytes read plus bytes written, from the median
    of timed copies of a ``nbytes`` buffer (after warm-up)."""
    from pagellm.platforms import current_platform

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = [current_platform.device_seconds(lambda: dst.copy_(src)) for _ in range(13)][3:]
    return 2 * nbytes / sorted(times)[len(times) // 2]


def run_pagellm(
    args: argparse.Namespace, requests: list[datasets.BenchRequest]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Runs the workload through the engine, one timed step at a time; returns the summary and
    what the peer run needs (config, pad id), after shutting the engine down."""
    from pagellm import LLM, SamplingParams
    from pagellm.engine.args import EngineArgs
    from pagellm.outputs import RequestOutput
    from pagellm.sampling_params import RequestOutputKind

    started = time.perf_counter()
    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    startup_s = time.perf_counter() - started  # load, profile, KV cache, graphs, warm-up
    engine = llm.llm_engine
    core = engine.engine_core
    config = engine.config
    detokenize = not config.model.skip_tokenizer_init
    params = [
        SamplingParams(
            temperature=args.temperature,
            max_tokens=r.output_len,
            ignore_eos=True,
            detokenize=detokenize,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        for r in requests
    ]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up

    device = torch.device(config.device.device)
    copy_bw = measure_copy_bandwidth(device)
    spec = core.executor.get_kv_cache_spec()
    kv_bytes_per_token = spec.page_size_bytes // spec.block_size * config.model.num_layers
    weight_bytes = core.decode_weight_bytes()

    clock = time.perf_counter
    steady_time = 0.0
    steady_bytes = 0
    steady_steps = 0
    num_steps = 0
    produced = 0
    # Time to first token: every request arrives at `start`; its first token is out after the
    # step that sampled it (read from the in-process scheduler: the outputs are final only).
    scheduled = core.scheduler.requests
    awaiting_first = {f"bench-{i}" for i in range(len(prompts))}
    ttfts: list[float] = []
    finished_ids: dict[str, list[int]] = {}
    start = clock()
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"bench-{i}", prompt, p)
    while engine.has_unfinished_requests():
        t0 = clock()
        outputs = engine.step()
        elapsed = clock() - t0
        if awaiting_first:
            now = clock() - start
            for rid in [
                r for r in awaiting_first if r not in scheduled or scheduled[r].output_token_ids
            ]:
                awaiting_first.discard(rid)
                ttfts.append(now)
        num_steps += 1
        for o in outputs:
            if o.finished and isinstance(o, RequestOutput):  # a generative model's: all are
                produced += len(o.outputs[0].token_ids)
                finished_ids[o.request_id] = o.outputs[0].token_ids
        stats = core.make_scheduler_stats()
        # Steady-state decode: every request has arrived and every running one decodes.
        decode_only = stats.num_scheduled_tokens == stats.num_scheduled_reqs > 1
        if decode_only and stats.num_waiting_reqs == 0:
            steady_time += elapsed
            steady_bytes += weight_bytes + stats.num_context_tokens * kv_bytes_per_token
            steady_steps += 1
    total_elapsed = clock() - start
    expected = sum(r.output_len for r in requests)
    if produced != expected:
        raise RuntimeError(f"pagellm produced {produced} output tokens, expected {expected}.")
    result = _summary("pagellm", requests, total_elapsed)
    result["num_steps"] = num_steps
    result["startup_s"] = round(startup_s, 2)
    # Two runs that generated the same tokens (async scheduling on and off, say) hash the same.
    digest = hashlib.sha256()
    for i in range(len(prompts)):
        digest.update(np.asarray(finished_ids[f"bench-{i}"], dtype=np.int64).tobytes())
    result["output_token_ids_sha256"] = digest.hexdigest()
    if ttfts:
        ttft_ms = np.array(ttfts) * 1e3
        result["ttft_ms"] = {
            "mean": round(float(ttft_ms.mean()), 1),
            "median": round(float(np.median(ttft_ms)), 1),
            "p99": round(float(np.percentile(ttft_ms, 99)), 1),
        }
    result["num_preemptions"] = core.scheduler.num_preemptions
    result["kv_cache_blocks"] = core.kv_cache_manager.block_pool.num_blocks
    result["kv_cache_tokens"] = result["kv_cache_blocks"] * spec.block_size
    result["kv_cache_dtype"] = config.cache.cache_dtype
    result["quantization"] = config.quantization
    result["decode_weight_gb"] = round(weight_bytes / 1e9, 3)
    result["attention_backend"] = config.attention_backend
    result["cudagraph_mode"] = config.compilation.cudagraph_mode
    result["piecewise_capture_sizes"] = config.compilation.piecewise_capture_sizes
    if steady_steps:
        achieved = steady_bytes / steady_time
        result["decode_roofline"] = {
            "steady_decode_steps": steady_steps,
            "mean_step_ms": round(steady_time / steady_steps * 1e3, 3),
            "bytes_per_step_gb": round(steady_bytes / steady_steps / 1e9, 3),
            "achieved_gb_per_s": round(achieved / 1e9, 1),
            "copy_bandwidth_gb_per_s": round(copy_bw / 1e9, 1),
            "fraction_of_roofline": round(achieved / copy_bw, 3),
        }
    pad_token_id = getattr(llm.get_tokenizer(), "pad_token_id", None) or 0
    peer = {"config": config, "pad_token_id": pad_token_id}
    core.shutdown()
    del llm, engine, core
    gc.collect()  # the peer's allocations reuse what the engine held
    return result, peer


def _hf_model(args: argparse.Namespace, config: Any) -> Any:
    """The same checkpoint in transformers (dummy: the same architecture, randomly initialised
    on the device)."""
    from transformers import AutoModelForCausalLM

    device = config.device.device
    kwargs: dict[str, Any] = {"dtype": config.model.torch_dtype}
    if args.hf_attn_implementation or args.hf_mode == "continuous":
        kwargs["attn_implementation"] = args.hf_attn_implementation or "paged|sdpa"
    if config.load.load_format == "dummy":
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config.model.hf_config, **kwargs)
    elif config.model.gguf_file:
        directory, name = os.path.split(config.model.gguf_file)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(config.model.model, **kwargs)
    return model.to(device).eval()


def run_hf(
    args: argparse.Namespace, requests: list[datasets.BenchRequest], peer: dict[str, Any]
) -> dict[str, Any]:
    from transformers import GenerationConfig

    model = _hf_model(args, peer["config"])
    device = next(model.parameters()).device
    pad = peer["pad_token_id"]
    sample = args.temperature > 0
    start = time.perf_counter()
    if args.hf_mode == "continuous":
        gen_config = GenerationConfig(
            do_sample=sample,
            temperature=args.temperature or None,
            max_new_tokens=max(r.output_len for r in requests),
            eos_token_id=-1,
            pad_token_id=pad,
        )
        manager = model.init_continuous_batching(generation_config=gen_config)
        manager.start()
        try:
            for i, r in enumerate(requests):
                manager.add_request(
                    r.prompt_token_ids, request_id=str(i), max_new_tokens=r.output_len
                )
            for _ in requests:
                if manager.get_result(timeout=600) is None:
                    raise RuntimeError(
                        "transformers continuous batching returned no result in 600 s."
                    )
        finally:
            manager.stop(block=True)
    else:
        with torch.inference_mode():
            for b in range(0, len(requests), args.hf_max_batch_size):
                batch = requests[b : b + args.hf_max_batch_size]
                width = max(len(r.prompt_token_ids) for r in batch)
                ids = torch.full((len(batch), width), pad, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for i, r in enumerate(batch):  # left padding
                    ids[i, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
                    mask[i, width - len(r.prompt_token_ids) :] = 1
                new = max(r.output_len for r in batch)
                model.generate(
                    ids.to(device),
                    attention_mask=mask.to(device),
                    do_sample=sample,
                    temperature=args.temperature if sample else None,
                    top_p=None,
                    top_k=None,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    pad_token_id=pad,
                )
    elapsed = time.perf_counter() - start
    result = _summary(f"hf-{args.hf_mode}", requests, elapsed)
    del model
    gc.collect()
    return result


def main(args: argparse.Namespace) -> int:
    from pagellm.model_loader import default_model_path
    from pagellm.platforms import current_platform

    if args.model is None:
        args.model = default_model_path()
    if args.max_model_len is None:
        (_, longest_in), (_, longest_out) = datasets.length_ranges(args)
        args.max_model_len = longest_in + longest_out + 1
    result: dict[str, Any] = {
        "workload": {
            "model": os.path.basename(args.model.rstrip("/")),
            "load_format": args.load_format,
            **datasets.dataset_record(args),
        },
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "device": current_platform.device_name(),
        },
    }
    # Build the engine first: its tokenizer and config define the workload's vocabulary.
    from pagellm import LLM  # noqa: F401  (import cost outside the timed region)
    from pagellm.engine.args import EngineArgs
    from pagellm.tokenizer import get_tokenizer

    config = EngineArgs.from_cli_args(args).create_engine_config()
    tokenizer = (
        None
        if config.model.skip_tokenizer_init
        else get_tokenizer(config.model.tokenizer, config.model.trust_remote_code)
    )
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    requests = requests_from_args(args, config.model.vocab_size, special)
    llm_result, peer = run_pagellm(args, requests)
    result["pagellm"] = llm_result
    if args.backend == "hf":
        try:
            hf_result = run_hf(args, requests, peer)
        except Exception as exc:  # the peer failing must not lose pagellm's measurement
            logging.getLogger(__name__).exception("The transformers run failed")
            result["hf"] = {"error": f"{type(exc).__name__}: {exc}"}
        else:
            result["hf"] = hf_result
            result["output_throughput_ratio"] = round(
                llm_result["output_tokens_per_s"] / hf_result["output_tokens_per_s"], 2
            )
    datasets.print_result(result, args.output_json)
    return 0
