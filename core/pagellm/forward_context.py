"""The forward context: per-step attention metadata that attention layers read during the forward pass.

Models keep the vLLM-style signature ``forward(input_ids, positions)``; what attention needs for the
step (built once by the model runner) travels here instead of through every layer's arguments.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardContext:
    attn_metadata: Any


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(attn_metadata: Any) -> Iterator[None]:
    global _current
    previous = _current
    _current = ForwardContext(attn_metadata)
    try:
        yield
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("No forward context is set: run the model inside set_forward_context().")
    return _current
