"""`ServerArgs`: the options of ``pagellm serve`` other than the engine's (`EngineArgs`), one
field per flag, built once from the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

API_KEY_ENV = "PAGELLM_API_KEY"
DEFAULT_ENDPOINTS = ("openai", "embeddings")
"""One endpoint plugin per kind of model: each attaches only to a model with its tasks (the OpenAI
API to a generative model, /v1/embeddings to a pooling one)."""


def _option(default: Any, help: str, **argparse_kwargs: Any) -> Any:
    return dataclasses.field(default=default, metadata={"help": help, **argparse_kwargs})


def _names(csv: str) -> list[str]:
    return [name.strip() for name in csv.split(",") if name.strip()]


def _chat_template(value: str) -> str:
    """``--chat-template``: a file's text, or the template itself, with its backslash escapes
    (``\\n``) decoded as a shell leaves them."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as file:
            return file.read()
    if not any(c in value for c in "{}\n"):
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither a readable file nor a Jinja template"
        )
    return value.encode("latin-1", "backslashreplace").decode("unicode_escape")


def _json_list(value: str) -> list[str]:
    """``--allowed-origins '["https://a.example"]'``: a JSON list of strings, as vLLM takes it."""
    try:
        items = json.loads(value)
    except ValueError:
        items = None
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise argparse.ArgumentTypeError(f"{value!r} is not a JSON list of strings")
    return items


@dataclass(frozen=True)
class ServerArgs:
    model: str = dataclasses.field(metadata={"help": "A HF model directory or a GGUF file."})
    host: str = _option("127.0.0.1", "Address to listen on.")
    port: int = _option(8000, "Port to listen on.")
    api_key: str | None = _option(
        None,
        "Require 'Authorization: Bearer KEY' on every route but /health "
        f"(default: ${API_KEY_ENV}).",
    )
    endpoints: Sequence[str] = _option(
        DEFAULT_ENDPOINTS,
        "Comma-separated endpoint plugins to serve when VLLM_PLUGINS is unset (when it is set, "
        "it alone decides); each attaches only if the model has the tasks it requires.",
        type=_names,
    )
    served_model_name: list[str] | None = _option(
        None, "Model name(s) clients use in requests (default: the model argument).", nargs="+"
    )
    max_request_body_bytes: int = _option(
        1 << 20, "Larger request bodies are refused with HTTP 400."
    )
    stat_loggers: Sequence[str] = _option(
        (),
        "Comma-separated stat loggers of pagellm.stat_logger_plugins to add to the built-in ones "
        "(the periodic log line, unless --disable-log-stats, and Prometheus /metrics).",
        type=_names,
    )
    disable_log_stats: bool = _option(
        False,
        "No periodic stats line in the log (throughput, running and waiting requests, KV cache "
        "use); /metrics still has them.",
        action="store_true",
    )
    shutdown_timeout: float = _option(
        5.0,
        "On SIGTERM/SIGINT, seconds until the process exits: in-flight requests may finish until "
        "shortly before; those still running then end with an error (a stream with an error "
        "event and [DONE]).",
    )
    max_sequences_per_request: int = _option(
        256, "Most sequences one HTTP request may ask for (prompts × n); more get HTTP 400."
    )
    max_waiting_requests: int = _option(
        1024,
        "Most sequences that may wait for the engine beyond those it runs; past it, requests get "
        "HTTP 503 with Retry-After (0: no limit).",
    )
    header_timeout: float = _option(
        10.0, "Seconds a connection may take to send a request's headers before it is closed."
    )
    body_timeout: float = _option(
        30.0, "Seconds a request may take to send its body before it gets HTTP 408."
    )
    enable_log_requests: bool = _option(
        False,
        "Log each request as it is sent to the engine (its id, prompt length, priority and "
        "sampling parameters; never the prompt's text) and each abort.",
        action="store_true",
    )
    uvicorn_log_level: str = _option(
        "info",
        "The level of uvicorn's log (its start-up, shutdown and access lines), as vLLM's flag.",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
    )
    disable_uvicorn_access_log: bool = _option(
        False,
        "Log no line per HTTP request (by default, as vLLM: client, method, path, status).",
        action="store_true",
    )
    # TLS and a proxy's path prefix, with vLLM's flags.
    ssl_keyfile: str | None = _option(
        None, "The TLS private key file (with --ssl-certfile: HTTPS)."
    )
    ssl_certfile: str | None = _option(None, "The TLS certificate chain file.")
    ssl_ca_certs: str | None = _option(
        None, "CA certificates clients' certificates are checked against (--ssl-cert-reqs)."
    )
    ssl_cert_reqs: int = _option(
        0,
        "Client certificates: 0 none asked (default), 1 checked when sent, 2 required (Python's "
        "ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED).",
        choices=(0, 1, 2),
    )
    root_path: str | None = _option(
        None,
        "The path prefix a proxy serves the API under and strips (e.g. /llm): the routes stay "
        "where they are; links the server makes (/docs) carry the prefix.",
    )
    # CORS, with vLLM's flags and defaults (any origin, method and header; no credentials).
    allowed_origins: Sequence[str] = _option(
        ("*",),
        'Origins browsers may call the API from, as a JSON list (default ["*"]: any).',
        type=_json_list,
    )
    allowed_methods: Sequence[str] = _option(
        ("*",),
        'HTTP methods allowed across origins, as a JSON list (default ["*"]).',
        type=_json_list,
    )
    allowed_headers: Sequence[str] = _option(
        ("*",),
        'Request headers allowed across origins, as a JSON list (default ["*"]).',
        type=_json_list,
    )
    allow_credentials: bool = _option(
        False,
        "Let browsers send credentials (cookies, Authorization) across origins.",
        action="store_true",
    )
    disable_fastapi_docs: bool = _option(
        False, "Serve no /docs, /redoc or /openapi.json.", action="store_true"
    )
    # Chat templates (the openai endpoint plugin).
    chat_template: str | None = _option(
        None,
        "A Jinja chat template, or a file holding one, to render chat messages with instead of "
        "the tokenizer's (the field holds the template's text).",
        type=_chat_template,
    )
    trust_request_chat_template: bool = _option(
        False,
        "Let requests bring their own chat_template (Jinja the server then renders); refused "
        "with HTTP 400 otherwise.",
        action="store_true",
    )
    # OpenAI responses: vLLM's output extensions.
    enable_prompt_tokens_details: bool = _option(
        False,
        "Report usage.prompt_tokens_details.cached_tokens (prompt tokens found in the prefix "
        "cache) in completions and chat completions.",
        action="store_true",
    )
    return_tokens_as_token_ids: bool = _option(
        False,
        "Write the tokens of logprobs as 'token_id:N' unless a request's "
        "return_tokens_as_token_ids says otherwise.",
        action="store_true",
    )

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """The model argument, then one ``--flag`` per other field."""
        for f in dataclasses.fields(cls):
            kwargs = dict(f.metadata)
            if f.name == "model":
                parser.add_argument("model", **kwargs)
                continue
            if "action" not in kwargs:
                kwargs.setdefault("type", str if f.default is None else type(f.default))
            parser.add_argument("--" + f.name.replace("_", "-"), default=f.default, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: vars(args)[f.name] for f in dataclasses.fields(cls)})

    def check_tls(self) -> None:
        """``ValueError`` naming the flag when the TLS flags do not make a whole: a key without
        its certificate (or the reverse), a file that is not there, client certificates asked
        for with no CA to check them against."""
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both for HTTPS.")
        for flag, path in (
            ("--ssl-keyfile", self.ssl_keyfile),
            ("--ssl-certfile", self.ssl_certfile),
            ("--ssl-ca-certs", self.ssl_ca_certs),
        ):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{flag} {path}: no such file.")
        if self.ssl_certfile is None and (self.ssl_ca_certs or self.ssl_cert_reqs):
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need HTTPS (--ssl-certfile).")
        if self.ssl_cert_reqs and self.ssl_ca_certs is None:
            raise ValueError("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs to check certificates.")

    @property
    def served_model_names(self) -> list[str]:
        """The names clients may ask for; the first is the one reported."""
        return list(self.served_model_name or [self.model])
