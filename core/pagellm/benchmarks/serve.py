"""``pagellm bench serve``: a load generator for a running server, through its OpenAI-compatible
HTTP API (``/v1/completions`` or ``/v1/chat/completions``), on the random dataset.

Requests arrive as a Poisson process at ``--request-rate`` (``inf``: all at once), at most
``--max-concurrency`` in flight; every one streams, asks for exactly its output length
(``max_tokens`` with ``ignore_eos``) and reads its token counts from the stream's final ``usage``.
Times are taken on the client: time to first token (TTFT) is from sending the request to the first
chunk with text, inter-token latency (ITL) is between text chunks, time per output token (TPOT) is
a request's (latency - TTFT) / (output tokens - 1).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from pagellm.benchmarks import datasets

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url", default=None, help="The server's URL (default: http://HOST:PORT)."
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", choices=ENDPOINTS, default="/v1/completions")
    parser.add_argument(
        "--model", default=None, help="The served model name (default: the first of /v1/models)."
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="Local tokenizer (model directory or GGUF) for the prompts' vocabulary and, for chat, "
        "their text (default: the served model name, when it is a local path).",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="Let that tokenizer's own code (auto_map) run, as the server's flag of that name.",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("PAGELLM_API_KEY"),
        help="Sent as a bearer token (default: $PAGELLM_API_KEY).",
    )
    datasets.add_dataset_args(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Requests per second, Poisson arrivals (default inf: all at once).",
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=None, help="At most this many requests in flight."
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="Seconds to wait for the server's next bytes before a request fails.",
    )


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    """None when no chunk carried text."""
    latency_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)


def _body(
    args: argparse.Namespace, model: str, request: datasets.BenchRequest, tokenizer: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": request.output_len,
        "ignore_eos": True,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.endpoint == "/v1/chat/completions":
        text = tokenizer.decode(request.prompt_token_ids)
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = request.prompt_token_ids
    return body


def _is_token_chunk(chunk: dict[str, Any]) -> bool:
    """Whether the chunk brings generated tokens: any completions chunk with a choice (its text may
    be empty: held back by the detokenizer, or a server without a tokenizer), a chat chunk whose
    delta has content (the first chat chunk only announces the role)."""
    choices = chunk.get("choices")
    if not choices:
        return False
    return "delta" not in choices[0] or bool(choices[0]["delta"].get("content"))


async def _send(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], expected_tokens: int
) -> RequestResult:
    """One streamed request. The stream is read line by line as Server-Sent Events define lines
    (ends: LF, CR LF; never the Unicode line separators that ``str.splitlines`` also breaks on)."""
    result = RequestResult()
    clock = time.perf_counter
    start = last = clock()
    usage = None
    loads = json.loads
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")
                result.error = f"HTTP {response.status}: {text[:300]}"
                return result
            async for raw_line in response.content:
                if not raw_line.startswith(b"data:"):
                    continue
                data = raw_line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = loads(data)
                if "error" in chunk:
                    result.error = f"error in stream: {json.dumps(chunk['error'])[:300]}"
                    return result
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if _is_token_chunk(chunk):
                    now = clock()
                    if result.ttft_s is None:
                        result.ttft_s = now - start
                    else:
                        result.itls_s.append(now - last)
                    last = now
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency_s = clock() - start
    if usage is None:
        result.error = "the stream ended without usage (stream_options.include_usage)"
        return result
    result.prompt_tokens = int(usage["prompt_tokens"])
    result.output_tokens = int(usage["completion_tokens"])
    if result.output_tokens != expected_tokens:
        result.error = (
            f"{result.output_tokens} output tokens, expected {expected_tokens} (ignore_eos)"
        )
        return result
    result.ok = True
    return result


async def _run(
    args: argparse.Namespace,
    base_url: str,
    model: str,
    requests: list[datasets.BenchRequest],
    tokenizer: Any,
) -> tuple[list[RequestResult], float]:
    url = base_url + args.endpoint
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0)
    # --timeout bounds every wait for the server's next bytes, not a whole (long) stream.
    timeout = aiohttp.ClientTimeout(
        total=None, connect=args.timeout, sock_connect=args.timeout, sock_read=args.timeout
    )
    gaps = np.random.default_rng(args.seed).exponential(1.0 / args.request_rate, len(requests))
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bodies = [_body(args, model, r, tokenizer) for r in requests]

    async with aiohttp.ClientSession(
        headers=headers, connector=connector, timeout=timeout, read_bufsize=1 << 20
    ) as session:

        async def one(body: dict[str, Any], expected: int) -> RequestResult:
            async with semaphore or contextlib.nullcontext():
                return await _send(session, url, body, expected)

        start = time.perf_counter()
        tasks = []
        for i, (body, request) in enumerate(zip(bodies, requests, strict=True)):
            if i and args.request_rate != float("inf"):
                await asyncio.sleep(gaps[i])
            tasks.append(asyncio.create_task(one(body, request.output_len)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return list(results), duration


def _served_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(base_url + "/v1/models", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            listing = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise ValueError(
            f"GET {base_url}/v1/models returned HTTP {exc.code}: "
            f"{exc.read().decode(errors='replace')[:300]}; pass --model (and --api-key if the "
            "server needs one)."
        ) from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ValueError(
            f"Could not reach {base_url} ({type(exc).__name__}: {exc}); is `pagellm serve` "
            "running there? Pass --base-url or --host/--port."
        ) from exc
    models = listing.get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model.")
    return str(models[0]["id"])


def _percentiles_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ms = np.asarray(values) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    stats = {"mean": ms.mean(), "p50": p50, "p90": p90, "p99": p99}
    return {name: round(float(value), 3) for name, value in stats.items()}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """Counts, throughput and latency percentiles (ms) of the completed requests."""
    done = [r for r in results if r.ok]
    timed = [(r, r.ttft_s) for r in done if r.ttft_s is not None]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": errors[:5],
        "duration_s": round(duration, 3),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_s": round(len(done) / duration, 3),
        "output_tokens_per_s": round(output_tokens / duration, 2),
        "total_tokens_per_s": round((input_tokens + output_tokens) / duration, 2),
        "ttft_ms": _percentiles_ms([ttft for _, ttft in timed]),
        "tpot_ms": _percentiles_ms(
            [
                (r.latency_s - ttft) / (r.output_tokens - 1)
                for r, ttft in timed
                if r.output_tokens > 1
            ]
        ),
        "itl_ms": _percentiles_ms([t for r in done for t in r.itls_s]),
        "e2e_latency_ms": _percentiles_ms([r.latency_s for r in done]),
    }


def main(args: argparse.Namespace) -> int:
    from pagellm.tokenizer import get_tokenizer

    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be positive (or inf), got {args.request_rate}.")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}.")
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    model = args.model or _served_model(base_url, args.api_key)
    try:
        tokenizer = get_tokenizer(args.tokenizer or model, args.trust_remote_code)
    except (ValueError, OSError) as exc:
        raise ValueError(
            f"Could not load the tokenizer for the prompts: {exc} Pass --tokenizer with a local "
            "model directory or GGUF file."
        ) from exc
    requests = datasets.requests_from_args(args, len(tokenizer), set(tokenizer.all_special_ids))
    results, duration = asyncio.run(_run(args, base_url, model, requests, tokenizer))
    result: dict[str, Any] = {
        "workload": {
            "base_url": base_url,
            "endpoint": args.endpoint,
            "model": model,
            **datasets.dataset_record(args),
            "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
            "max_concurrency": args.max_concurrency,
        },
        "client_machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
        **summarize(results, duration),
    }
    datasets.print_result(result, args.output_json)
    return 0 if result["failed"] == 0 else 1
