"""What quantization methods share about the layers they quantize: which checkpoint layers a
fused layer of pagellm's models is made of, whether a checkpoint's ignore list names a layer, and
the frozen parameters their weights are stored in."""

from __future__ import annotations

import re

import torch
from torch import nn

# A fused layer of pagellm's models and the checkpoint layers it is made of.
FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def checkpoint_layer_names(prefix: str) -> list[str]:
    """The checkpoint's names of the layer(s) pagellm's layer ``prefix`` is made of."""
    head, _, last = prefix.rpartition(".")
    parts = FUSED_PARTS.get(last)
    return [f"{head}.{p}" if head else p for p in parts] if parts else [prefix]


def is_ignored_layer(name: str, ignored: tuple[str, ...], *, inner_modules: bool = False) -> bool:
    """Whether an ignore list names checkpoint layer ``name``: an entry ``re:PATTERN`` matches
    it from its start, another entry names it whole or by its last components; with
    ``inner_modules``, an entry naming a module the layer lies in names it too."""
    for entry in ignored:
        if entry.startswith("re:"):
            if re.match(entry[3:], name):
                return True
        elif (
            name == entry
            or name.endswith("." + entry)
            or inner_modules
            and f".{entry}." in f".{name}."
        ):
            return True
    return False


def frozen_parameter(data: torch.Tensor, loader: object | None = None) -> nn.Parameter:
    """``data`` as a parameter without gradients, loaded by ``loader`` (a ``weight_loader``)
    when given."""
    param = nn.Parameter(data, requires_grad=False)
    if loader is not None:
        param.weight_loader = loader  # type: ignore[attr-defined]
    return param
