"""The kit's fixtures and parametrization; pytest loads this file only when it collects the kit's
cases (``--pagellm-platform`` / ``--pagellm-backend``).

A case taking ``backend`` runs once per backend given; one that also takes a probe (``dtype``,
``head_size``, ``block_size``, ``kv_cache_dtype``, ``undeclared``) runs once per value of it that
the backend's declarations call for (`probes`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pagellm.testing.conformance import TARGETS
from pagellm.testing.conformance.probes import (
    Selection,
    declared_block_sizes,
    declared_dtypes,
    declared_head_sizes,
    declared_kv_cache_dtypes,
    dtype_name,
    undeclared_selections,
)
from pagellm.testing.conformance.targets import BackendTarget, PlatformTarget
from pagellm.testing.conformance.tiny_model import write_tiny_llama

PROBES: dict[str, Callable[[BackendTarget], list[Any]]] = {
    "dtype": lambda t: declared_dtypes(t.require_class()),
    "head_size": lambda t: declared_head_sizes(t.require_class()),
    "block_size": lambda t: declared_block_sizes(t.require_class()),
    "kv_cache_dtype": lambda t: declared_kv_cache_dtypes(t.require_class()),
    "undeclared": undeclared_selections,
}


def _label(value: object) -> str:
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, Selection):
        return value.what.replace(" ", "_")
    return str(value)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" not in metafunc.fixturenames:
        return
    backends = metafunc.config.stash[TARGETS].backends
    probe = next((name for name in PROBES if name in metafunc.fixturenames), None)
    argnames = ["backend", *([probe] if probe else [])]
    params = []
    for target in backends:
        if probe is None:
            params.append(pytest.param(target, id=target.name))
        elif target.cls is None:  # one case, which fails with the reason the class is missing
            params.append(pytest.param(target, None, id=f"{target.name}-{probe}"))
        else:
            params += [
                pytest.param(target, value, id=f"{target.name}-{_label(value)}")
                for value in PROBES[probe](target)
            ]
    if not backends:
        skip = pytest.mark.skip(reason="no --pagellm-backend given")
        params = [pytest.param(*[None] * len(argnames), marks=skip, id="no-backend")]
    metafunc.parametrize(argnames, params)


@pytest.fixture(scope="session")
def platform(request: pytest.FixtureRequest) -> PlatformTarget:
    target = request.config.stash[TARGETS].platform
    if target is None:
        pytest.skip("no --pagellm-platform given")
    return target


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], str]:
    """``tiny_llama(head_size)``: the directory of a tiny random Llama with that head size, saved
    once per size."""
    made: dict[int, str] = {}

    def make(head_size: int) -> str:
        if head_size not in made:
            directory = Path(tmp_path_factory.mktemp(f"tiny_llama_{head_size}"))
            made[head_size] = write_tiny_llama(directory, head_size)
        return made[head_size]

    return make
