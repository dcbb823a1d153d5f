"""Real ``pagellm serve`` processes on 127.0.0.1 for the server tests: a tiny random Llama with
SmolLM2's whole vocabulary to serve, the endpoint packages installed, and `Server`, one process
driven by httpx and the official ``openai`` client.

conftest.py loads this module as a plugin (``pytest_plugins``), so its fixtures reach every test
module without an import, and the session-scoped ones (the model, `shared_server`) are made once.

A module whose servers need only session fixtures declares them in ``server_specs(request)`` and
takes them with `module_servers`: they are then started two modules ahead (`start_servers_ahead`),
while earlier tests run, as `shared_server` is.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import openai
import pytest
import torch

from editable_installs import editable_installs

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {
    "pagellm-openai": ROOT / "plugins" / "endpoints" / "openai",
    "pagellm-admin": ROOT / "plugins" / "endpoints" / "admin",
    "pagellm-io-embeddings": ROOT / "plugins" / "io_processors" / "embeddings",
}
DUMMY_ENDPOINT = ROOT / "tests" / "plugins" / "dummy_endpoint"
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 64
MODEL_NAME = "tiny"
IDLE_TIMEOUT_S = 30


def _missing_first_party() -> list[Path]:
    missing = []
    for dist, project in FIRST_PARTY.items():
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            missing.append(project)
    return missing


@pytest.fixture(scope="module")
def endpoint_packages(first_party_endpoints: None) -> Iterator[None]:
    """The first-party endpoint packages (`first_party_endpoints`); the test package always, from
    this checkout (an install left by another checkout must not stand in for it)."""
    with editable_installs([DUMMY_ENDPOINT]):
        yield


@pytest.fixture(scope="session")
def first_party_endpoints() -> Iterator[None]:
    """The first-party endpoint packages unless installed already (``make install-test`` installs
    them), for the whole session: `shared_server` serves them to several modules."""
    with editable_installs(_missing_first_party()):
        yield


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: str) -> str:
    """A tiny random Llama whose vocabulary is the whole SmolLM2 tokenizer's, so that any text
    (and the chat template's special tokens) is a valid prompt."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory = str(tmp_path_factory.mktemp("served_model"))
    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_MODEL_LEN,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # peaked logits: varied, reproducible text
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.08)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """One ``pagellm serve`` process; its output goes to a log file the tests read."""

    def __init__(self, model: str, log_path: Path, env: dict[str, str], *args: str) -> None:
        self.model = model
        self.port = free_port()
        # HTTPS when the flags ask for it: a self-signed certificate is its own CA.
        self.verify: ssl.SSLContext | bool = True
        scheme = "http"
        if "--ssl-certfile" in args:
            self.verify = ssl.create_default_context(cafile=args[args.index("--ssl-certfile") + 1])
            scheme = "https"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.log_path = log_path
        controls = ("VLLM_PLUGINS", "PAGELLM_API_KEY", "PAGELLM_PLUGINS_STRICT")
        full_env = {k: v for k, v in os.environ.items() if k not in controls}
        full_env.update(env)
        self.api_key = full_env.get("PAGELLM_API_KEY")
        cmd = [
            sys.executable,
            "-m",
            "pagellm.entrypoints.cli",
            "serve",
            model,
            "--port",
            str(self.port),
            "--served-model-name",
            MODEL_NAME,
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
            "--kv-cache-memory",
            str(16 << 20),
            *args,
        ]
        self._log = open(log_path, "w")  # noqa: SIM115 (open for the process's lifetime)
        self.proc = subprocess.Popen(cmd, env=full_env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 240) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pagellm serve exited ({self.proc.returncode}):\n{self.log()}")
            try:
                if (
                    httpx.get(f"{self.url}/health", timeout=2, verify=self.verify).status_code
                    == 200
                ):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"pagellm serve did not become healthy:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()

    def engine_pid(self) -> int:
        match = re.search(r"Engine process \S+: pid (\d+)", self.log())
        assert match, self.log()
        return int(match.group(1))

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none")

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none")

    def get(self, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
        headers = {**self.headers(), **(headers or {})}
        return httpx.get(f"{self.url}{path}", headers=headers, timeout=60, verify=self.verify)

    def post(
        self, path: str, headers: dict[str, str] | None = None, timeout: float = 60, **kwargs
    ) -> httpx.Response:
        headers = {**self.headers(), **(headers or {})}
        return httpx.post(
            f"{self.url}{path}", headers=headers, timeout=timeout, verify=self.verify, **kwargs
        )

    def state(self) -> dict:
        response = self.get("/v1/admin/state")
        assert response.status_code == 200, response.text
        return response.json()

    def wait_idle(self) -> dict:
        """The admin state once no request runs or waits (a disconnect is noticed asynchronously)."""
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while True:
            state = self.state()
            idle = state["num_running"] == 0 and state["num_waiting"] == 0
            if (idle and state["num_free_blocks"] == state["num_total_blocks"]) or (
                time.monotonic() > deadline
            ):
                return state
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


ServerSpecs = dict[str, tuple[dict[str, str], tuple[str, ...]]]


def start_servers(model: str, logs: Path, specs: ServerSpecs) -> dict[str, Server]:
    """One server per spec (environment, extra flags), all started, none waited for."""
    return {
        name: Server(model, logs / f"{name}.log", env, *args) for name, (env, args) in specs.items()
    }


@contextlib.contextmanager
def ready_servers(started: dict[str, Server]) -> Iterator[dict[str, Server]]:
    """``started`` once each is healthy; all stopped after."""
    try:
        yield {name: server.wait_ready() for name, server in started.items()}
    finally:
        for server in started.values():
            server.stop()


def started_servers(
    model: str, logs: Path, specs: ServerSpecs
) -> AbstractContextManager[dict[str, Server]]:
    """Start one server per spec together; stop them all after."""
    return ready_servers(start_servers(model, logs, specs))


# A module's `server_specs` servers start when the module this many places before it starts: the
# tests in between (in-process ones use one core of two) run while they start.
AHEAD = 2


def _specs_of(module: pytest.Module, request: pytest.FixtureRequest) -> tuple[str, ServerSpecs]:
    request.getfixturevalue("first_party_endpoints")
    return module.obj.server_specs(request)


@pytest.fixture(scope="session")
def servers_started_ahead() -> Iterator[dict[str, dict[str, Server]]]:
    """The servers started ahead, by the node id of the module they are for, until it takes them;
    any left at the end (a module whose tests did not ask for them) are stopped."""
    started: dict[str, dict[str, Server]] = {}
    try:
        yield started
    finally:
        for servers in started.values():
            for server in servers.values():
                server.stop()


@pytest.fixture(scope="module", autouse=True)
def start_servers_ahead(request: pytest.FixtureRequest) -> None:
    """At each module's start, start the servers of the modules `AHEAD` places on that declare
    ``server_specs`` (only modules with a selected test count)."""
    modules = list(dict.fromkeys(item.getparent(pytest.Module) for item in request.session.items))
    if request.node not in modules:
        return
    here = modules.index(request.node)
    coming = [m for m in modules[here + 1 : here + 1 + AHEAD] if hasattr(m.obj, "server_specs")]
    if not coming:
        return
    started = request.getfixturevalue("servers_started_ahead")
    for module in coming:
        if module.nodeid not in started:
            model, specs = _specs_of(module, request)
            logs = request.getfixturevalue("tmp_path_factory").mktemp("server_logs")
            started[module.nodeid] = start_servers(model, logs, specs)


def module_servers(request: pytest.FixtureRequest) -> AbstractContextManager[dict[str, Server]]:
    """The servers of the requesting module's ``server_specs``, those started ahead or else
    started now; ready; stopped after."""
    module = request.node.getparent(pytest.Module)
    started = request.getfixturevalue("servers_started_ahead").pop(module.nodeid, None)
    if started is None:
        model, specs = _specs_of(module, request)
        logs = request.getfixturevalue("tmp_path_factory").mktemp("server_logs")
        started = start_servers(model, logs, specs)
    return ready_servers(started)


NEEDS_SHARED_SERVER = pytest.StashKey[bool]()


def pytest_collection_finish(session: pytest.Session) -> None:
    session.config.stash[NEEDS_SHARED_SERVER] = any(
        "shared_server" in getattr(item, "fixturenames", ()) for item in session.items
    )


@pytest.fixture(scope="session", autouse=True)
def prestart_shared_server(request: pytest.FixtureRequest) -> None:
    """Starts `shared_server` with the session when a selected test uses it, and waits for it
    only when a test first does: it starts meanwhile on the core that the in-process tests
    (one OpenMP thread) leave idle on a 2-core machine."""
    if request.config.stash.get(NEEDS_SHARED_SERVER, False):
        request.getfixturevalue("shared_server_process")


@pytest.fixture(scope="session")
def shared_server_process(
    first_party_endpoints: None, model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    logs = tmp_path_factory.mktemp("shared_server_logs")
    server = Server(model_dir, logs / "shared.log", {"VLLM_PLUGINS": "openai,admin"})
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def shared_server(shared_server_process: Server) -> Server:
    """One server with the defaults and ``VLLM_PLUGINS=openai,admin``, started once for the session
    and shared by the modules whose tests need nothing else of it (each leaves it idle)."""
    return shared_server_process.wait_ready()


def self_signed_certificate(directory: Path) -> tuple[str, str]:
    """A key and a self-signed certificate for 127.0.0.1 (its own CA), for HTTPS servers."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = directory / "key.pem", directory / "cert.pem"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_path), str(cert_path)
