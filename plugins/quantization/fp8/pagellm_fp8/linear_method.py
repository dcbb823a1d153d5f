"""`Fp8LinearMethod`: a linear layer's float8 weight and scales, from the checkpoint or quantized
at load, and its forward through the GEMM `gemm.choose_gemm` picks for the device.

Under tensor parallelism (`checkpoint_split`) a rank reads the float8 weight's rows or columns
like a float weight's, a per-channel scale's rows with them (whole in a row-parallel layer,
whose rank keeps every output channel), a block scale's rows or columns of 128x128 blocks (so
each rank's part must be whole blocks), and per-tensor weight and input scales whole.

After `process_weights_after_loading` a layer holds, whatever the checkpoint held:
``weight`` [N, K] in the scheme's float8 format (`Fp8Scheme.fp8_dtype`); ``weight_scale`` float32
[1] (tensor), [N, 1] (channel) or [N/128, K/128] (block); ``input_scale`` float32 [1] for static
activation scales, else None. Checkpoints are float8_e4m3fn: where the platform computes in
float8_e4m3fnuz their weights are converted exactly, with the weight and input scales doubled
(`e4m3fn_to_e4m3fnuz`)."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from pagellm.layers.linear import CheckpointTensor
from pagellm.layers.parallel_linear import TensorParallelError
from pagellm.quantization import (
    InputQuantizer,
    LayerSplit,
    LinearMethodBase,
    QuantizedActivation,
    TensorSplit,
)
from pagellm.quantization.fp8_formats import E4M3FNUZ, e4m3fn_to_e4m3fnuz
from pagellm.quantization.layers import frozen_parameter
from pagellm_fp8.gemm import GemmFn, choose_gemm, shape_refusal
from pagellm_fp8.input_quant import make_input_quantizer
from pagellm_fp8.quant_ops import FP8_DTYPE, dequantize_weight, quantize_weight, to_fp8
from pagellm_fp8.scheme import BLOCK, Fp8Scheme


def _offsets(sizes: list[int]) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


def _blocks_misfit(in_features: int, sizes: list[int] | tuple[int, ...]) -> bool:
    return any(s % BLOCK[0] for s in sizes) or bool(in_features % BLOCK[1])


def _check_block_divides(
    layer_name: str, in_features: int, sizes: list[int], split: LayerSplit | None
) -> None:
    if not _blocks_misfit(in_features, sizes):
        return
    if split is not None and not _blocks_misfit(split.full_in_features, split.full_output_sizes):
        raise TensorParallelError(
            f"{layer_name}: split over tensor_parallel_size {split.tp_size}, rank "
            f"{split.rank}'s part of the weight (output parts {sizes}, input {in_features}) is "
            f"not whole fp8 blocks of {list(BLOCK)}; choose a tensor_parallel_size that "
            "leaves every rank multiples of 128, or fp8_per_channel / fp8_per_tensor."
        )
    raise ValueError(
        f"fp8 block size {list(BLOCK)} does not divide the weight of {layer_name} "
        f"(output parts {sizes}, input {in_features}); block-scaled fp8 needs every "
        "dimension to be a multiple of 128: choose fp8_per_channel or fp8_per_tensor."
    )


def _load_rows(
    sizes: list[int],
    rows_per_scale: int,
    name: str,
    param: nn.Parameter,
    tensor: torch.Tensor,
    shard: int | None,
) -> None:
    """Rows of fused part ``shard`` (all rows when unfused); a block scale covers 128 rows."""
    dst = param.data
    if shard is not None:
        start = _offsets(sizes)[shard] // rows_per_scale
        dst = dst.narrow(0, start, sizes[shard] // rows_per_scale)
    if dst.shape != tensor.shape:
        raise ValueError(
            f"Checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}."
        )
    dst.copy_(tensor)


def _load_part_scalar(
    name: str, param: nn.Parameter, tensor: torch.Tensor, shard: int | None
) -> None:
    """A per-tensor scale (shape [] or [1]) into the slot of fused part ``shard``."""
    if tensor.numel() != 1:
        raise ValueError(
            f"Checkpoint tensor {name} has shape {tuple(tensor.shape)}; a per-tensor scale has one value."
        )
    param.data[shard or 0] = tensor.reshape(())


class Fp8LinearMethod(LinearMethodBase):
    def __init__(self, scheme: Fp8Scheme, prefix: str) -> None:
        self.scheme = scheme
        self.prefix = prefix
        self.gemm_path = "unset"  # the chosen path's name, once the weights are processed
        self._gemm: GemmFn | None = None

    def create_weights(
        self,
        layer: nn.Module,
        in_features: int,
        out_features: int,
        bias: bool,
        params_dtype: torch.dtype,
    ) -> None:
        scheme = self.scheme
        sizes: list[int] = list(getattr(layer, "output_sizes", None) or [out_features])
        if scheme.weights == "block":
            split = getattr(layer, "tp_split", None)
            _check_block_divides(self.prefix, in_features, sizes, split)
        if scheme.serialized:
            weight = torch.empty(out_features, in_features, dtype=FP8_DTYPE)
            layer.register_parameter(
                "weight",
                frozen_parameter(weight, partial(_load_rows, sizes, 1, f"{self.prefix}.weight")),
            )
            scale_name = f"{self.prefix}.{scheme.scale_name}"
            if scheme.weights == "tensor":
                scale = frozen_parameter(
                    torch.empty(len(sizes), dtype=torch.float32),
                    partial(_load_part_scalar, scale_name),
                )
            elif scheme.weights == "channel":
                scale = frozen_parameter(
                    torch.empty(out_features, 1, dtype=torch.float32),
                    partial(_load_rows, sizes, 1, scale_name),
                )
            else:
                shape = (out_features // BLOCK[0], in_features // BLOCK[1])
                scale = frozen_parameter(
                    torch.empty(shape, dtype=torch.float32),
                    partial(_load_rows, sizes, BLOCK[0], scale_name),
                )
            layer.register_parameter(scheme.scale_name, scale)
            if scheme.static_activations:
                input_scale = torch.empty(len(sizes), dtype=torch.float32)
                loader = partial(_load_part_scalar, f"{self.prefix}.input_scale")
                layer.register_parameter("input_scale", frozen_parameter(input_scale, loader))
        else:
            # Float weights from the checkpoint (the model loads their rows); quantized once loaded.
            weight = torch.empty(out_features, in_features, dtype=params_dtype)
            layer.register_parameter("weight", frozen_parameter(weight))
        bias_param = (
            frozen_parameter(torch.empty(out_features, dtype=params_dtype)) if bias else None
        )
        layer.register_parameter("bias", bias_param)

    def checkpoint_split(
        self, param_name: str, tensor: CheckpointTensor, split: LayerSplit
    ) -> TensorSplit | None:
        scheme = self.scheme
        if not scheme.serialized or param_name != scheme.scale_name:
            return super().checkpoint_split(param_name, tensor, split)  # weight, bias, input scale
        column = split.parallel == "column"
        if scheme.weights == "channel":
            return TensorSplit(0) if column else None
        if scheme.weights == "block":
            return TensorSplit(0 if column else 1, BLOCK[0 if column else 1], unit="fp8 block")
        return None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scheme = self.scheme
        weight = layer.get_parameter("weight").data
        input_scale = None
        if not scheme.serialized:
            q, scale = quantize_weight(weight, scheme.weights, scheme.fp8_dtype)
        else:
            q, scale = weight, layer.get_parameter(scheme.scale_name).data
            if scheme.weights == "tensor" and scale.numel() > 1:
                q, scale = self._one_scale_for_parts(layer, q, scale)
            if scheme.static_activations:
                # One calibrated scale for the fused input: the largest of the parts' covers each.
                input_scale = layer.get_parameter("input_scale").data.amax().reshape(1)
            if scheme.fp8_dtype == E4M3FNUZ:
                q, scale, input_scale = e4m3fn_to_e4m3fnuz(q, scale, input_scale)
            delattr(layer, scheme.scale_name)
        layer.register_parameter("weight", frozen_parameter(q))
        layer.register_parameter("weight_scale", frozen_parameter(scale.float().contiguous()))
        layer.register_parameter(
            "input_scale", frozen_parameter(input_scale) if input_scale is not None else None
        )
        refusal = shape_refusal(scheme, q.device, q.shape[0], q.shape[1])
        if refusal is not None:
            raise ValueError(f"{self.prefix}: {refusal} (use a float model or another scheme)")
        self.gemm_path, self._gemm = choose_gemm(scheme, q.device)

    @staticmethod
    def _one_scale_for_parts(
        layer: nn.Module, q: torch.Tensor, scales: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused parts (q, k, v) with a per-tensor scale each: requantize to the largest, so one
        per-tensor GEMM serves the fused layer (the other parts lose at most their low bits)."""
        if bool((scales == scales[0]).all()):
            return q, scales[:1]
        largest = scales.amax().reshape(1)
        sizes = list(layer.output_sizes)  # type: ignore[arg-type]
        parts = []
        for start, size, part_scale in zip(_offsets(sizes), sizes, scales, strict=True):
            part = dequantize_weight(q.narrow(0, start, size), part_scale, "tensor")
            parts.append(to_fp8(part, largest))
        return torch.cat(parts), largest

    def _processed_gemm(self) -> GemmFn:
        if self._gemm is None:
            raise RuntimeError(f"{self.prefix}: fp8 weights used before they were processed.")
        return self._gemm

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = self._processed_gemm()(
            x.reshape(-1, shape[-1]),
            layer.get_parameter("weight"),
            layer.get_parameter("weight_scale"),
            layer.input_scale,  # type: ignore[arg-type]
        )
        return self._finish(layer, out, shape)

    def input_quantizer(self, layer: nn.Module) -> InputQuantizer | None:
        """The norm or activation before this layer writes its input in fp8 (`input_quant`;
        on unless ``PAGELLM_FP8_FUSED_INPUT_QUANT=0``)."""
        return make_input_quantizer(
            self.scheme,
            self._processed_gemm(),
            self.gemm_path,
            layer.input_scale,  # type: ignore[arg-type]
        )

    def apply_quantized(self, layer: nn.Module, x: QuantizedActivation) -> torch.Tensor:
        shape = x.data.shape
        out = self._processed_gemm().matmul(
            x.data.reshape(-1, shape[-1]),
            x.scale,
            layer.get_parameter("weight"),
            layer.get_parameter("weight_scale"),
            x.dtype,
        )
        return self._finish(layer, out, shape)

    @staticmethod
    def _finish(layer: nn.Module, out: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        bias = layer.bias
        if isinstance(bias, torch.Tensor):
            out = out + bias
        return out.reshape(*shape[:-1], out.shape[-1])
