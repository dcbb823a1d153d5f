"""`Int4Scheme`: how one checkpoint's linear layers are quantized to 4 bits (what every other
module reads)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Int4Format = Literal["gptq", "awq", "compressed-tensors"]

BITS = 4
PACK = 8
"""4-bit values in one int32, in every format."""


@dataclass(frozen=True)
class Int4Scheme:
    format: Int4Format
    group_size: int
    """Input columns sharing one scale (and zero); -1: one group over the whole input."""
    sym: bool = True
    """Symmetric: every zero point is the middle of the range (8), none stored by AWQ/CT."""
    desc_act: bool = False
    """GPTQ's act-order: ``g_idx`` maps each input column to its group, in no particular order
    (compressed-tensors' ``actorder: group`` with ``weight_g_idx`` likewise)."""
    gptq_v1: bool = True
    """GPTQ ``checkpoint_format: gptq`` (v1) stores each zero point minus one; ``gptq_v2`` as is."""
    ignored: tuple[str, ...] = field(default=())
    """Checkpoint layer names (or ``re:`` patterns) left unquantized."""

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else in_features // self.group_size

    def group_of(self, in_features: int) -> int:
        """The number of input columns per group for a layer of ``in_features``."""
        return in_features if self.group_size == -1 else self.group_size
