"""The API-server process's CPU time per streamed token: a real ``pagellm serve`` on 127.0.0.1
around a tiny model, driven by ``pagellm bench serve`` (all requests at once, streaming
``/v1/completions``, ``ignore_eos``, greedy).

The model is Qwen3-shaped but tiny (1 layer, hidden size 64, dummy weights, SmolLM2's tokenizer),
so the engine core makes tokens about as fast on a 2-core CPU as W2 does on the H200 (~18k/s) and
what is measured is the front end's work per token: output processing, detokenization, SSE
chunks, HTTP. The server's and the engine core's user + system CPU time over the benchmark run
(not the start-up) are divided by the tokens streamed. Prints one JSON object.

    OMP_NUM_THREADS=1 python benchmarks/serve_cpu_cost.py [--skip-tokenizer-init] [--repeat 3]
        [--py-spy server.txt]   # also sample the API server's stacks (py-spy, collapsed format)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

VOCAB = 4096  # the first ids of SmolLM2's tokenizer: a small LM head, a fast engine


def make_model_dir(directory: Path) -> Path:
    """A 1-layer Qwen3 config with hidden size 64 and SmolLM2's tokenizer (weights: dummy)."""
    from transformers import AutoConfig, AutoTokenizer

    from pagellm.model_loader import default_model_path
    from pagellm.model_loader.source import resolve_model_source

    tokenizer = AutoTokenizer.from_pretrained(
        resolve_model_source(default_model_path()).hf_directory()
    )
    config = AutoConfig.for_model(
        "qwen3",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        architectures=["Qwen3ForCausalLM"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pagellm serve exited ({proc.returncode}):\n{log.read_text()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"pagellm serve did not become healthy:\n{log.read_text()}")


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _system_s(process: psutil.Process) -> float:
    return process.cpu_times().system


def _writes(process: psutil.Process) -> int:
    """Write system calls so far (the HTTP chunks' among them; zmq sends are not counted)."""
    return process.io_counters().write_count


def _engine_cpu_s(server: psutil.Process) -> float:
    total = 0.0
    for child in server.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += _cpu_s(child)
    return total


def _bench_command(args: argparse.Namespace, port: int, model_dir: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pagellm.entrypoints.cli",
        "bench",
        "serve",
        "--port",
        str(port),
        "--tokenizer",
        str(model_dir),
        "--num-prompts",
        str(args.num_prompts),
        "--input-len-range",
        *map(str, args.input_len_range),
        "--output-len-range",
        *map(str, args.output_len_range),
        "--random-token-range",
        "0",
        str(VOCAB),
        "--temperature",
        "0",
        "--seed",
        str(args.seed),
        "--output-json",
        str(out),
    ]


def one_run(args: argparse.Namespace, url: str, port: int, model_dir: Path, run: int) -> dict:
    server = psutil.Process(args.server_pid)
    out = args.work / f"bench_{run}.json"
    spy = None
    if args.py_spy and run == 0:
        spy_bin = shutil.which("py-spy")
        if spy_bin is None:
            raise RuntimeError("--py-spy needs py-spy on PATH (pip install py-spy).")
        spy = subprocess.Popen(
            [spy_bin, "record", "-p", str(server.pid), "-r", "500", "--nonblocking", "-f", "raw"]
            + ["-o", args.py_spy],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)
    api0, engine0, t0 = _cpu_s(server), _engine_cpu_s(server), time.perf_counter()
    system0, writes0 = _system_s(server), _writes(server)
    bench = subprocess.run(
        _bench_command(args, port, model_dir, out), capture_output=True, text=True, check=False
    )
    api1, engine1, wall = _cpu_s(server), _engine_cpu_s(server), time.perf_counter() - t0
    system1, writes1 = _system_s(server), _writes(server)
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        spy.wait(60)
    if bench.returncode != 0:
        raise RuntimeError(f"pagellm bench serve failed:\n{bench.stdout}\n{bench.stderr}")
    result = json.loads(out.read_text())
    tokens = result["total_output_tokens"]
    return {
        "api_server_us_per_token": round((api1 - api0) / tokens * 1e6, 2),
        "api_server_system_us_per_token": round((system1 - system0) / tokens * 1e6, 2),
        "api_server_writes_per_token": round((writes1 - writes0) / tokens, 3),
        "engine_core_us_per_token": round((engine1 - engine0) / tokens * 1e6, 2),
        "api_server_cpu_s": round(api1 - api0, 3),
        "wall_s": round(wall, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": result["output_tokens_per_s"],
        "tpot_ms": result["tpot_ms"],
        "itl_ms": result["itl_ms"],
        "failed": result["failed"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len-range", type=int, nargs=2, default=(16, 64))
    parser.add_argument("--output-len-range", type=int, nargs=2, default=(128, 512))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="Benchmark runs on one server.")
    parser.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="Serve without a tokenizer (token ids only, empty texts), as W2 is served.",
    )
    parser.add_argument(
        "--stream-interval", type=int, default=1, help="The server's --stream-interval."
    )
    parser.add_argument("--py-spy", default=None, help="Sample the first run's API server here.")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        args.work = Path(tmp)
        model_dir = make_model_dir(args.work / "model")
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        log = args.work / "server.log"
        max_len = args.input_len_range[1] + args.output_len_range[1] + 1
        cmd = [
            sys.executable,
            "-m",
            "pagellm.entrypoints.cli",
            "serve",
            str(model_dir),
            "--load-format",
            "dummy",
            "--port",
            str(port),
            "--max-model-len",
            str(max_len),
            "--max-num-seqs",
            str(max(args.num_prompts, 1)),
            "--kv-cache-memory",
            str(512 << 20),
        ]
        if args.skip_tokenizer_init:
            cmd.append("--skip-tokenizer-init")
        if args.stream_interval != 1:
            cmd += ["--stream-interval", str(args.stream_interval)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(log, "w") as log_file:
            proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT)
            try:
                _wait_healthy(proc, url, log)
                args.server_pid = proc.pid
                runs = [one_run(args, url, port, model_dir, i) for i in range(args.repeat)]
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    per_token = sorted(r["api_server_us_per_token"] for r in runs)
    record: dict[str, Any] = {
        "benchmark": "serve_cpu_cost",
        "workload": {
            "model": "qwen3, 1 layer, hidden 64, dummy weights, SmolLM2 tokenizer",
            "num_prompts": args.num_prompts,
            "input_len_range": list(args.input_len_range),
            "output_len_range": list(args.output_len_range),
            "skip_tokenizer_init": args.skip_tokenizer_init,
            "stream_interval": args.stream_interval,
            "stream": "/v1/completions, all at once, ignore_eos, temperature 0",
        },
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
        "api_server_us_per_token_median": per_token[len(per_token) // 2],
        "runs": runs,
    }
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
