"""How the kit compares a backend's attention outputs with the reference's, and says what
differed: the case, the step, the layer, and the worst value with where it is."""

from __future__ import annotations

import torch

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
"""Absolute and relative, against TORCH_SDPA in float32 from the same (rounded) inputs: a
backend may round softmax weights to the dtype before multiplying them with the values."""


class ConformanceFailure(AssertionError):
    """A case found the plugin doing something other than what it declares or the contract
    says; the message names the case and what differed."""


def check_output(out: object, num_tokens: int, width: int, dtype: torch.dtype, what: str) -> None:
    """``AttentionImpl.forward`` returns [num_tokens, num_heads * head_size] in the query's dtype."""
    if not isinstance(out, torch.Tensor):
        raise ConformanceFailure(f"{what}: forward returned {type(out).__name__}, not a tensor")
    if tuple(out.shape) != (num_tokens, width) or out.dtype != dtype:
        raise ConformanceFailure(
            f"{what}: forward returned a {out.dtype} tensor of shape {tuple(out.shape)}; the "
            f"contract is {dtype} of shape ({num_tokens}, {width}) (tokens, heads x head size)"
        )


def describe_rows(rows: list[tuple[int, int]], seq_lens: list[int]) -> str:
    parts = []
    for (request, new), seq_len in zip(rows, seq_lens, strict=True):
        cached = seq_len - new
        after = f" after {cached} cached" if cached else ""
        parts.append(f"request {request}: {new} token{'s' if new > 1 else ''}{after}")
    return "; ".join(parts)


def difference(
    got: torch.Tensor,
    expected: torch.Tensor,
    num_heads: int,
    positions: list[tuple[int, int]],
    tolerance: float,
) -> str | None:
    """None when ``got`` matches ``expected`` (both [T, H * D] float32); else what differed."""
    got3 = got.view(got.shape[0], num_heads, -1)
    exp3 = expected.view(got3.shape)
    bad = ~torch.isclose(got3, exp3, atol=tolerance, rtol=tolerance)
    if not bad.any():
        return None
    error = (got3 - exp3).abs().nan_to_num(nan=float("inf"))
    token, head, dim = (int(i) for i in torch.unravel_index(error.argmax(), error.shape))
    request, position = positions[token]
    nan = int(got3.isnan().sum())
    nans = f" ({nan} of them NaN)" if nan else ""
    return (
        f"{int(bad.sum())} of {bad.numel()} values differ by more than {tolerance:g} "
        f"(absolute and relative){nans}; the largest at token {token} (request {request}, "
        f"position {position}), query head {head}, dim {dim}: got {got3[token, head, dim]:.6g}, "
        f"expected {exp3[token, head, dim]:.6g}"
    )
