"""The ``gguf`` quantization method: each linear keeps its GGUF blocks and runs them through the
Triton kernels (``ops.gguf_linear``).

The loader hands each linear part (q, k, v of qkv_proj; gate, up of gate_up_proj) its raw rows as
stored in the file. Parts can have different types (a Q4_K_M file stores v and down in Q6_K), so
after loading, consecutive parts of one type are joined into one matrix of blocks and repacked
once into the kernels' aligned planes (``planes.py``; the raw blocks are then dropped), and a
layer whose parts differ runs one product per type and joins the outputs. A part the kernels do
not read (F32, F16, or another block type, dequantized by the reader) runs as a float matrix.

Under tensor parallelism (`GGUFLinearMethod.checkpoint_split`) a column-parallel rank reads its
rows of blocks (one row per output feature), a row-parallel rank its run of blocks in each row:
its input features must be whole blocks (32 weights, 256 for the K-quants), else loading is
refused with the layer's name.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.layers.linear import CheckpointTensor
from pagellm.quantization import LayerSplit, LinearMethodBase, QuantizationConfig, TensorSplit
from pagellm_gguf.block_types import block_shape, type_name
from pagellm_gguf.planes import GGUFPlanes, repack


class GGUFLinearMethod(LinearMethodBase):
    """One per linear layer (``get_linear_method`` makes a new one): it holds the layer's parts
    while they load, then the GGUF type of each joined segment."""

    def __init__(self) -> None:
        self.parts: dict[int, tuple[int | None, torch.Tensor]] = {}
        self.types: list[int | None] = []
        """The GGUF type of each segment; None: float weights (parameter ``gguf_weight_<i>``)."""
        self.segments: list[GGUFPlanes | torch.Tensor] = []
        """Each segment's planes (parameters ``gguf_<plane>_<i>``) or float weight."""
        self.in_features = 0

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

        def load_part(param: nn.Parameter, tensor: torch.Tensor, shard: int | None) -> None:
            qtype = getattr(tensor, "gguf_type", None)  # None: a float part
            part = tensor.to(param.device, params_dtype if qtype is None else torch.uint8)
            self.parts[0 if shard is None else shard] = (qtype, part)

        weight.weight_loader = load_part  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)
        self.in_features = in_features
        bias_param = torch.empty(out_features, dtype=params_dtype) if bias else None
        layer.register_parameter(
            "bias",
            nn.Parameter(bias_param, requires_grad=False) if bias_param is not None else None,
        )

    def checkpoint_split(
        self, param_name: str, tensor: CheckpointTensor, split: LayerSplit
    ) -> TensorSplit | None:
        qtype = getattr(tensor, "gguf_type", None)
        if param_name != "weight" or qtype is None or split.parallel == "column":
            return super().checkpoint_split(param_name, tensor, split)  # rows; float parts
        block_size, type_size = block_shape(qtype)
        return TensorSplit(1, block_size, type_size, unit=f"{type_name(qtype)} block")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        sizes: list[int] = getattr(layer, "output_sizes", [])
        if sorted(self.parts) != list(range(len(sizes))):
            raise ValueError(
                f"the gguf method got GGUF weights for parts {sorted(self.parts)} of "
                f"{len(sizes)}: it runs the weights of a GGUF file (load_format gguf) only."
            )
        segments: list[tuple[int | None, list[torch.Tensor]]] = []
        for shard, rows in enumerate(sizes):
            qtype, part = self.parts[shard]
            if part.shape[0] != rows:
                raise ValueError(f"A GGUF weight part has {part.shape[0]} rows, expected {rows}.")
            if segments and segments[-1][0] == qtype:
                segments[-1][1].append(part)
            else:
                segments.append((qtype, [part]))
        for i, (qtype, tensors) in enumerate(segments):
            # Parameters, not buffers: the worker counts a model's weight bytes from them.
            joined = torch.cat(tensors)
            self.types.append(qtype)
            if qtype is None:
                weight = nn.Parameter(joined.contiguous(), requires_grad=False)
                layer.register_parameter(f"gguf_weight_{i}", weight)
                self.segments.append(weight)
                continue
            planes = repack(joined, qtype, self.in_features)
            for name, plane in planes.tensors().items():
                param = nn.Parameter(plane, requires_grad=False)
                layer.register_parameter(f"gguf_{name}_{i}", param)
                setattr(planes, name, param)  # the planes run the registered tensors
            self.segments.append(planes)
        del layer.weight
        self.parts.clear()

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        from pagellm_gguf.ops import gguf_linear  # Triton: imported where the kernels run

        outputs = [
            gguf_linear(x, segment) if isinstance(segment, GGUFPlanes) else F.linear(x, segment)
            for segment in self.segments
        ]
        y = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
        bias = layer.get_parameter("bias") if layer.bias is not None else None
        return y if bias is None else y + bias


class GGUFConfig(QuantizationConfig):
    """GGUF weights kept quantized (as planes) on a CUDA GPU (chosen by itself for a GGUF file there)."""

    name: ClassVar[str] = "gguf"
    reads_model_format: ClassVar[str | None] = "gguf"

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
    def tensor_parallel_refusal(cls, tp_size: int, checkpoint_config: dict[str, Any]) -> str | None:
        """Blocks split by rows or by whole blocks (`GGUFLinearMethod.checkpoint_split`);
        a rank whose input features are not whole blocks is refused when the model is built."""
        return None

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
