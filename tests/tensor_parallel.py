"""Helpers of the tensor-parallel loading tests (tests/distributed and the quantization plugins'):

- `as_rank`: build layers or a whole model in this process as one rank of a tensor-parallel
  group, to compare what each rank loads with the slice of the one-rank model's tensors. The
  group is a real `GroupCoordinator` without a process group: building and loading use no
  collective, so none is faked; a forward's all-reduce would fail, so such tests run each
  layer's ``linear_method.apply`` and add the ranks' partial outputs themselves.
- `load_model_as_rank`: the engine's own loader (`pagellm.model_loader.load_model`) as one rank.
- `rank_slice`: the part of the one-rank layer's [N, K] weight that a rank's layer holds.
- `rank_product_errors`: how far the ranks' products, put together, are from the one-rank
  layer's, layer by layer (through each linear method's ``apply``: its GEMM on the device).
- `run_ranks`: spawn real gloo ranks (TCP on 127.0.0.1) that each run a function.
- `greedy_record` / `assert_same_greedy`: what a rank generated (tokens and top logprobs, as
  plain data that crosses the spawn), and its comparison with the one-rank engine's.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from pagellm.distributed import (
    GroupCoordinator,
    destroy_distributed,
    init_distributed,
    parallel_state,
)


@contextlib.contextmanager
def as_rank(rank: int, tp: int) -> Iterator[None]:
    """Within the block, `get_tp_group` is rank ``rank`` of ``tp`` (no process group)."""
    previous = parallel_state._TP
    parallel_state._TP = GroupCoordinator(ranks=list(range(tp)), rank_in_group=rank)
    try:
        yield
    finally:
        parallel_state._TP = previous


def load_model_as_rank(
    path: str, rank: int, tp: int, device: str = "cpu", **engine: Any
) -> nn.Module:
    """The model at ``path`` loaded (weights processed) as rank ``rank`` of ``tp`` on
    ``device``; ``engine``: `EngineArgs` keywords."""
    from pagellm.attention.registry import attention_backends
    from pagellm.engine.args import EngineArgs
    from pagellm.model_loader import load_model

    config = EngineArgs(path, **engine).create_engine_config()
    backend = attention_backends.get(config.attention_backend)
    with as_rank(rank, tp):
        return load_model(config, backend, torch.device(device))


def rank_slice(whole: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """The rows (column-parallel: the rank's rows of each fused part) or columns (row-parallel)
    of ``whole``, the one-rank layer's [N, K] weight, that the rank's ``layer`` holds."""
    split = layer.tp_split
    if split is None:
        return whole
    if split.parallel == "row":
        return whole[:, layer.input_start : layer.input_start + layer.local_in_features]
    offsets = [sum(split.full_output_sizes[:i]) for i in range(len(split.full_output_sizes))]
    rows = [
        whole[offset + start : offset + start + size]
        for offset, start, size in zip(offsets, layer.part_starts, layer.output_sizes, strict=True)
    ]
    return torch.cat(rows)


def rank_product_errors(
    whole: dict[str, nn.Module], ranks: list[dict[str, nn.Module]], dtype: torch.dtype
) -> dict[str, float]:
    """{layer: relative error} of the ranks' outputs for random inputs of ``dtype`` against the
    one-rank layer's: each column-parallel rank's output against its columns of the whole
    output, the row-parallel ranks' partial outputs (on their slices of the input) summed."""
    errors = {}
    generator = torch.Generator().manual_seed(0)
    for name, full in whole.items():
        split = ranks[0][name].tp_split
        x = torch.randn(3, split.full_in_features, generator=generator).to(dtype)
        x = x.to(next(full.parameters()).device)
        want = full.linear_method.apply(full, x).float()
        if split.parallel == "column":
            got = torch.cat([m[name].linear_method.apply(m[name], x).float() for m in ranks], 1)
            want = torch.cat([rank_slice(want.t(), m[name]).t() for m in ranks], 1)
        else:
            parts = [m[name].linear_method.apply(m[name], rank_slice(x, m[name])) for m in ranks]
            got = torch.stack([p.float() for p in parts]).sum(0)
        errors[name] = float((got - want).norm() / want.norm())
    return errors


def linears(model: nn.Module) -> dict[str, nn.Module]:
    from pagellm.layers.linear import Linear

    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, fn: Callable[..., Any], args: tuple, tp: int, port: int, results: Any):
    init_distributed(
        world_size=tp,
        rank=rank,
        tensor_parallel_size=tp,
        init_method=f"tcp://127.0.0.1:{port}",
        backend="gloo",
    )
    try:
        results[rank] = fn(rank, *args)
    finally:
        destroy_distributed()


def run_ranks(fn: Callable[..., Any], *args: Any, tp: int = 2) -> dict[int, Any]:
    """``fn(rank, *args)`` on each of ``tp`` spawned gloo ranks (``fn`` importable by name from
    a test module; its result picklable): {rank: result}."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(fn, args, tp, _free_port(), results), nprocs=tp, join=True)
        return dict(results)


def greedy_record(outputs: list[Any]) -> dict[str, list]:
    """The token ids and per-position top logprobs of ``LLM.generate``'s outputs, as plain data."""
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "logprobs": [
            [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs]
            for o in outputs
        ],
    }


def assert_same_greedy(got: dict[str, list], want: dict[str, list], tol: float, what: Any) -> None:
    """Identical tokens, the same top-logprob candidates, and their logprobs within ``tol``."""
    assert got["tokens"] == want["tokens"], what
    for got_prompt, want_prompt in zip(got["logprobs"], want["logprobs"], strict=True):
        for g, w in zip(got_prompt, want_prompt, strict=True):
            assert g.keys() == w.keys(), what
            for token, value in w.items():
                assert abs(g[token] - value) < tol, (what, token)
