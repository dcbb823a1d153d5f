"""Process groups and collectives for tensor parallelism (`parallel_state`)."""

from pagellm.distributed.parallel_state import (
    GroupCoordinator,
    destroy_distributed,
    get_tp_group,
    init_distributed,
)

__all__ = ["GroupCoordinator", "destroy_distributed", "get_tp_group", "init_distributed"]
