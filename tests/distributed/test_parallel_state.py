"""`pagellm.distributed`: two real gloo processes on this machine (spawned, TCP on 127.0.0.1)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from pagellm.distributed import destroy_distributed, get_tp_group, init_distributed
from pagellm.distributed.parallel_state import DistributedInitError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collectives(rank: int, port: int, results: dict) -> None:
    group = init_distributed(
        world_size=2,
        rank=rank,
        tensor_parallel_size=2,
        init_method=f"tcp://127.0.0.1:{port}",
        backend="gloo",
    )
    x = torch.arange(4, dtype=torch.float32) + 10 * rank
    result = {
        "rank_in_group": group.rank_in_group,
        "all_reduce": group.all_reduce(x.clone()).tolist(),
        "all_gather": group.all_gather(x.view(2, 2), dim=-1).tolist(),
        "broadcast": group.broadcast(x.clone(), src=1).tolist(),
        "same_group": get_tp_group() is group,
    }
    destroy_distributed()
    result["after"] = get_tp_group().world_size
    results[rank] = result  # one assignment: the manager's dict does not see nested changes


def test_two_gloo_ranks_reduce_gather_and_broadcast_in_rank_order():
    port = _free_port()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_collectives, args=(port, results), nprocs=2, join=True)
        results = dict(results)
    for rank in (0, 1):
        r = results[rank]
        assert r["rank_in_group"] == rank and r["same_group"]
        assert r["all_reduce"] == [10.0, 12.0, 14.0, 16.0]
        assert r["all_gather"] == [[0.0, 1.0, 10.0, 11.0], [2.0, 3.0, 12.0, 13.0]]
        assert r["broadcast"] == [10.0, 11.0, 12.0, 13.0]
        assert r["after"] == 1


def test_without_init_the_group_has_one_rank_and_collectives_return_their_input():
    group = get_tp_group()
    x = torch.ones(3)
    assert group.world_size == 1 and group.is_first_rank
    assert group.all_reduce(x) is x and group.all_gather(x) is x and group.broadcast(x) is x


@pytest.mark.parametrize(
    "world_size, tp, rank, message",
    [(3, 2, 0, "not a multiple"), (4, 2, 0, "only tensor parallelism"), (2, 2, 5, "outside")],
)
def test_layouts_that_cannot_be_built_are_refused_before_joining(world_size, tp, rank, message):
    with pytest.raises(DistributedInitError, match=message):
        init_distributed(
            world_size=world_size,
            rank=rank,
            tensor_parallel_size=tp,
            init_method="tcp://127.0.0.1:1",
            backend="gloo",
        )


def _gathered_sum(group):
    """A custom all-reduce of the kind a platform may offer: another algorithm (gather, then add)
    for tensors of at most four elements; larger ones are declined."""
    calls = []

    def reduce(x: torch.Tensor) -> torch.Tensor | None:
        if x.numel() > 4:
            return None
        calls.append(x.numel())
        parts = [torch.empty_like(x) for _ in group.ranks]
        torch.distributed.all_gather(parts, x, group=group.group)
        return torch.stack(parts).sum(dim=0)

    reduce.calls = calls
    return reduce


def _custom_all_reduce(rank: int, port: int, results: dict) -> None:
    group = init_distributed(
        world_size=2,
        rank=rank,
        tensor_parallel_size=2,
        init_method=f"tcp://127.0.0.1:{port}",
        backend="gloo",
        custom_all_reduce=_gathered_sum,
    )
    small = group.all_reduce(torch.arange(4, dtype=torch.float32) + 10 * rank).tolist()
    large = group.all_reduce(torch.ones(8) * (rank + 1)).tolist()
    results[rank] = {"small": small, "large": large, "calls": list(group.custom_all_reduce.calls)}
    destroy_distributed()


def test_a_platforms_custom_all_reduce_takes_the_tensors_it_accepts_and_declines_the_rest():
    port = _free_port()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_custom_all_reduce, args=(port, results), nprocs=2, join=True)
        results = dict(results)
    for rank in (0, 1):
        assert results[rank]["small"] == [10.0, 12.0, 14.0, 16.0]
        assert results[rank]["large"] == [3.0] * 8
        assert results[rank]["calls"] == [4]  # the large tensor went through torch.distributed


def test_the_built_in_platforms_offer_no_custom_all_reduce():
    from pagellm.platforms.cpu import CpuPlatform

    assert CpuPlatform.custom_all_reduce(get_tp_group()) is None
