"""`pagellm serve --tensor-parallel-size 2`: the engine-core process starts two worker processes
(gloo), and the server answers as the one-worker server does, token for token."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from servers import MODEL_NAME, Server, ServerSpecs, module_servers


def server_specs(request: pytest.FixtureRequest) -> tuple[str, ServerSpecs]:
    """From session fixtures only: `module_servers` may start it ahead of this module."""
    return request.getfixturevalue("model_dir"), {
        "tp2": ({"VLLM_PLUGINS": "openai,admin"}, ("--tensor-parallel-size", "2"))
    }


@pytest.fixture(scope="module")
def tp2(request: pytest.FixtureRequest) -> Iterator[Server]:
    with module_servers(request) as running:
        yield running["tp2"]


def _greedy(server: Server) -> list[tuple[str, list[int] | None]]:
    client = server.client()
    answers = []
    for prompt in ("The capital of France is", "1, 2, 3,"):
        out = client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=12,
            temperature=0.0,
            logprobs=1,
            extra_body={"ignore_eos": True},
        )
        choice = out.choices[0]
        answers.append((choice.text, choice.logprobs.tokens if choice.logprobs else None))
    return answers


def test_two_ranks_serve_the_same_greedy_completions_as_one(tp2: Server, shared_server: Server):
    assert _greedy(tp2) == _greedy(shared_server)


def test_the_engine_process_runs_one_worker_process_per_rank(tp2: Server):
    assert tp2.get("/health").status_code == 200
    engine = tp2.engine_pid()
    children = Path(f"/proc/{engine}/task/{engine}/children").read_text().split()
    assert len(children) == 2, children
