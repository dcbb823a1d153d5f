"""docs/serving.md's compatibility table of request fields against the request models: every
field the models declare is listed, with the status the models give it (implemented, accepted as
a no-op, refused), and a field of one route only is "n/a" on the other. The table's routes are
checked against a real server in test_openai_chat_and_routes.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pagellm_openai import field_policy
from pagellm_openai.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from pydantic import BaseModel

SERVING_MD = Path(__file__).resolve().parents[4] / "docs" / "serving.md"
SECTION = "## vLLM compatibility: request fields, routes, metrics"


def table_rows(header: str) -> list[list[str]]:
    """The cells of the rows of the section's table whose header line is ``header``."""
    text = SERVING_MD.read_text()
    section = text[text.index(SECTION) :]
    lines = section[section.index(header) :].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _no_ops() -> set[str]:
    return set(field_policy.AcceptedNoOps.model_fields)


def _refused() -> set[str]:
    classes: list[type[BaseModel]] = [
        field_policy.RefusedFields,
        field_policy.RefusedCompletionFields,
        field_policy.RefusedStreamOptions,
    ]
    return {name for cls in classes for name in cls.model_fields}


def status(model: type[BaseModel], name: str) -> str:
    """What the table must say of ``name`` (a field, or ``stream_options.FIELD``) on a route."""
    if name.startswith("stream_options."):
        model, name = StreamOptions, name.removeprefix("stream_options.")
    if name not in model.model_fields:
        return "n/a"
    if name == "best_of":  # implemented when equal to n, else refused (field_policy.check_best_of)
        return "✓ (= `n`)"
    if name in _no_ops():
        return "no-op"
    return "400" if name in _refused() else "✓"


FIELD_ROWS = table_rows("| field | from | completions | chat |")


def test_the_table_lists_every_declared_field_once():
    listed = [row[0].strip("`") for row in FIELD_ROWS]
    assert len(listed) == len(set(listed)), "a field is listed twice"
    declared = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    declared |= {f"stream_options.{name}" for name in StreamOptions.model_fields}
    assert set(listed) == declared


@pytest.mark.parametrize("row", FIELD_ROWS, ids=[row[0].strip("`") for row in FIELD_ROWS])
def test_each_fields_status_is_the_models(row: list[str]):
    name, _, on_completions, on_chat = row
    name = name.strip("`")
    assert on_completions == status(CompletionRequest, name)
    assert on_chat == status(ChatCompletionRequest, name)


def routes() -> list[tuple[str, str, bool]]:
    """(method, path, served) of each route the table names; ``{id}`` becomes a made-up id."""
    result = []
    for cell, verdict in table_rows("| route | pagellm |"):
        for method, path in re.findall(r"`(GET|POST) (/[^`]*)`", cell):
            result.append((method, path.replace("{id}", "resp-1"), verdict.startswith("✓")))
    return result
