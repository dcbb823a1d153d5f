"""The ``gguf`` quantization method: each linear keeps its GGUF blocks and runs them through the
Triton kernels (``ops.gguf_linear``).

The loader hands each linear part (q, k, v of qkv_proj; gate, up of gate_up_proj) its raw rows as
stored in the file. Parts can have different types (a Q4_K_M file stores v and down in Q6_K), so
after loading, consecutive parts of one type are joined into one matrix of blocks, and a layer
whose parts differ runs one product per type and joins the outputs. A part the kernels do not
read (F32, F16, or another block type, dequantized by the reader) runs as a float matrix.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.quantization import LinearMethodBase, QuantizationConfig


class GGUFLinearMethod(LinearMethodBase):
    def create_weights(
        self,
        layer: nn.Module,
        in_features: int,
        out_features: int,
        bias: bool,
        params_dtype: torch.dtype,
    ) -> None:
        # A placeholder the loader hands every part to: its size is known only from the file.
        weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        parts: dict[int, torch.Tensor] = {}

        def load_part(param: nn.Parameter, tensor: torch.Tensor, shard: int | None) -> None:
            qtype = getattr(tensor, "gguf_type", None)  # None: a float part
            part = tensor.to(param.device, params_dtype if qtype is None else torch.uint8)
            part.gguf_type = qtype  # type: ignore[attr-defined]
            parts[0 if shard is None else shard] = part

        weight.weight_loader = load_part  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)
        layer.gguf_parts = parts
        layer.gguf_in_features = in_features
        bias_param = torch.empty(out_features, dtype=params_dtype) if bias else None
        layer.register_parameter(
            "bias",
            nn.Parameter(bias_param, requires_grad=False) if bias_param is not None else None,
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        parts: dict[int, torch.Tensor] = layer.gguf_parts
        sizes: list[int] = layer.output_sizes  # type: ignore[assignment]
        if sorted(parts) != list(range(len(sizes))):
            raise ValueError(f"GGUF weights for parts {sorted(parts)} of {len(sizes)} were loaded.")
        segments: list[tuple[int | None, list[torch.Tensor]]] = []
        for shard in range(len(sizes)):
            part = parts[shard]
            if part.shape[0] != sizes[shard]:
                raise ValueError(
                    f"A GGUF weight part has {part.shape[0]} rows, expected {sizes[shard]}."
                )
            qtype = part.gguf_type
            if segments and segments[-1][0] == qtype:
                segments[-1][1].append(part)
            else:
                segments.append((qtype, [part]))
        types: list[int | None] = []
        for i, (qtype, tensors) in enumerate(segments):
            # Parameters, not buffers: the worker counts a model's weight bytes from them.
            weight = nn.Parameter(torch.cat(tensors).contiguous(), requires_grad=False)
            layer.register_parameter(f"gguf_weight_{i}", weight)
            types.append(qtype)
        layer.gguf_types = types
        del layer.weight, layer.gguf_parts

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        from pagellm_gguf.ops import gguf_linear  # Triton: imported where the kernels run

        outputs = []
        for i, qtype in enumerate(layer.gguf_types):  # type: ignore[arg-type]
            weight = layer.get_parameter(f"gguf_weight_{i}")
            outputs.append(F.linear(x, weight) if qtype is None else gguf_linear(x, weight, qtype))
        y = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
        return y if layer.bias is None else y + layer.bias


class GGUFConfig(QuantizationConfig):
    """GGUF weights kept as their blocks on a CUDA GPU (chosen by itself for a GGUF file there)."""

    name: ClassVar[str] = "gguf"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GGUFConfig:
        if config:
            raise ValueError(
                f"the gguf method reads GGUF files, not a checkpoint quantized with "
                f"quant_method {config.get('quant_method')!r}."
            )
        return cls()

    def get_linear_method(self, prefix: str) -> LinearMethodBase:
        return GGUFLinearMethod()

    @classmethod
    def platform_refusal(cls, device_type: str, dtype: torch.dtype) -> str | None:
        if device_type != "cuda":
            return (
                f"its Triton kernels run on CUDA GPUs, not on {device_type!r}; without "
                "--quantization a GGUF file's weights are dequantized at load there."
            )
        try:
            import triton  # noqa: F401
        except ImportError:
            return "Triton is not installed (pip install 'pagellm-gguf[triton]')."
        return None
