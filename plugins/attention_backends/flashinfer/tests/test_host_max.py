"""`host_max`: FlashInfer's plans take the longest row of a step with Python's ``max()`` over a
host tensor, which walks it row by row; shadowed, it is one tensor op with the same result."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from pagellm_flashinfer.host_max import shadow_max, tensor_max


class NotIterable(torch.Tensor):
    """Fails if anything walks it element by element, as the built-in max() would."""

    def __iter__(self):
        raise AssertionError("iterated row by row")


@pytest.fixture
def library(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A package like flashinfer: ``prefill`` plans with ``max()`` as FlashInfer 0.6 does;
    there is no ``decode`` module (skipped)."""
    package = types.ModuleType("fake_fi_pkg")
    package.__path__ = []  # a package, so that its submodules import
    prefill = types.ModuleType("fake_fi_pkg.prefill")
    exec("def longest(kv_lens):\n    return max(kv_lens).item()\n", vars(prefill))
    monkeypatch.setitem(sys.modules, "fake_fi_pkg", package)
    monkeypatch.setitem(sys.modules, "fake_fi_pkg.prefill", prefill)
    return package


def test_a_plan_takes_the_longest_row_without_walking_the_rows(library):
    lens = torch.tensor([17, 2048, 5, 300], dtype=torch.int32).as_subclass(NotIterable)
    prefill = sys.modules["fake_fi_pkg.prefill"]
    with pytest.raises(AssertionError, match="iterated"):
        prefill.longest(lens)  # the built-in
    assert shadow_max(library) == ["fake_fi_pkg.prefill"]
    assert prefill.longest(lens) == 2048


def test_tensor_max_is_the_built_in_for_everything_else():
    rows = torch.tensor([3, 9, 2], dtype=torch.int32)
    result = tensor_max(rows)
    assert result.dim() == 0 and result.dtype == torch.int32 and result.item() == 9
    assert tensor_max(rows).item() == max(rows).item()
    assert tensor_max([1, 5, 2]) == 5
    assert tensor_max(4, 7) == 7
    assert tensor_max([], default=-1) == -1
    assert tensor_max(["a", "bbb"], key=len) == "bbb"
    with pytest.raises(ValueError):
        tensor_max(torch.tensor([], dtype=torch.int32))  # the built-in's error for no rows
    grid = torch.tensor([[1, 2]])
    assert torch.equal(tensor_max(grid), max(grid))  # 2-D: the built-in's rows
