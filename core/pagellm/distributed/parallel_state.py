"""The process groups of one engine's workers, and the collectives the parallel layers use.

Each worker process calls `init_distributed` once, before it builds its model: the default
``torch.distributed`` group over every rank, then the tensor-parallel groups carved out of it
(consecutive ranks; one group while the pipeline dimension is 1, the only size built so far). The
collectives go through the platform's ``dist_backend`` (gloo on the CPU, NCCL on CUDA).

A process that never called it (one worker in the engine's own process, tests of one layer) sees
a tensor-parallel group of one rank, whose collectives return their input: single-process code
needs no set-up and no special cases.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

CustomAllReduce = Callable[[torch.Tensor], "torch.Tensor | None"]
"""A platform's own all-reduce for one group (`Platform.custom_all_reduce`): the sum of its
argument over the group's ranks, or None where it declines that tensor (too large, a dtype it does
not handle), which then goes through ``torch.distributed``. Every rank must decide alike."""


@dataclass
class GroupCoordinator:
    """One process group as this rank sees it: its ranks (global), its own place among them,
    and the collectives over them. ``group`` is None for a group of one rank."""

    ranks: list[int]
    rank_in_group: int
    group: dist.ProcessGroup | None = None
    custom_all_reduce: CustomAllReduce | None = None

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group's ranks: the platform's custom all-reduce where it has
        one that takes ``x``, else ``torch.distributed``'s (in place)."""
        if self.world_size == 1:
            return x
        if self.custom_all_reduce is not None:
            reduced = self.custom_all_reduce(x)
            if reduced is not None:
                return reduced
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in self.ranks]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``x`` of the group's rank ``src`` (a rank within the group), on every rank, in place."""
        if self.world_size == 1:
            return x
        dist.broadcast(x, src=self.ranks[src], group=self.group)
        return x


_SINGLE = GroupCoordinator(ranks=[0], rank_in_group=0)
_TP: GroupCoordinator | None = None


class DistributedInitError(RuntimeError):
    """The requested layout of ranks cannot be built."""


def init_distributed(
    *,
    world_size: int,
    rank: int,
    tensor_parallel_size: int,
    init_method: str,
    backend: str,
    custom_all_reduce: Callable[[GroupCoordinator], CustomAllReduce | None] | None = None,
) -> GroupCoordinator:
    """Join the engine's ``world_size`` ranks as ``rank`` (``init_method`` as
    ``torch.distributed.init_process_group`` takes it, e.g. ``tcp://127.0.0.1:PORT``) and build
    the tensor-parallel groups; returns this rank's. ``custom_all_reduce`` (the platform's hook of
    that name) is asked once for this rank's group when it has several ranks. Called once per
    worker process."""
    global _TP
    if world_size % tensor_parallel_size:
        raise DistributedInitError(
            f"world_size {world_size} is not a multiple of tensor_parallel_size "
            f"{tensor_parallel_size}"
        )
    if world_size != tensor_parallel_size:
        raise DistributedInitError(
            f"world_size {world_size} with tensor_parallel_size {tensor_parallel_size}: only "
            "tensor parallelism is built (pipeline_parallel_size 1)"
        )
    if not 0 <= rank < world_size:
        raise DistributedInitError(f"rank {rank} is outside [0, {world_size})")
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank)
    groups = [
        list(range(start, start + tensor_parallel_size))
        for start in range(0, world_size, tensor_parallel_size)
    ]
    mine = None
    for ranks in groups:
        # new_group must be called by every rank for every group, in the same order.
        group = dist.new_group(ranks, backend=backend) if len(ranks) > 1 else None
        if rank in ranks:
            mine = GroupCoordinator(ranks=ranks, rank_in_group=ranks.index(rank), group=group)
    if mine is None:  # unreachable: the groups cover every rank
        raise DistributedInitError(f"rank {rank} is in no tensor-parallel group")
    if custom_all_reduce is not None and mine.world_size > 1:
        mine.custom_all_reduce = custom_all_reduce(mine)
    _TP = mine
    return mine


def get_tp_group() -> GroupCoordinator:
    """This rank's tensor-parallel group (one rank where `init_distributed` was not called)."""
    return _TP if _TP is not None else _SINGLE


def destroy_distributed() -> None:
    """Leave the groups (a worker shutting down); afterwards `get_tp_group` has one rank."""
    global _TP
    _TP = None
    if dist.is_initialized():
        dist.destroy_process_group()
