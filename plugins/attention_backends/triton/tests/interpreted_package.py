"""pagellm-triton-attn imported under Triton's interpreter, for the tests of one module.

Triton reads TRITON_INTERPRET when a kernel is decorated and the backend reads it when imported,
so the package is imported afresh with it set; afterwards it is forgotten, and other modules
import it as on a machine without the variable.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest

PACKAGE = "pagellm_triton_attn"


def _forget_package() -> None:
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[name]


@contextlib.contextmanager
def interpreted(module: str) -> Iterator[ModuleType]:
    """``pagellm_triton_attn.<module>``, imported afresh with ``TRITON_INTERPRET=1``, which stays
    set until the context ends (modules the package imports lazily are interpreted too)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        _forget_package()
        try:
            yield importlib.import_module(f"{PACKAGE}.{module}")
        finally:
            _forget_package()
