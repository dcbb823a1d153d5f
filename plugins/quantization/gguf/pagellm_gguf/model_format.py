"""`GGUFModelFormat`: how pagellm reads a GGUF file (the ``gguf`` entry of ``pagellm.model_formats``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import ClassVar

import torch

from pagellm.model_loader.formats import ModelFormat
from pagellm.quantization import QuantizationConfig
from pagellm_gguf.hf_files import gguf_hf_dir
from pagellm_gguf.method import GGUFConfig
from pagellm_gguf.reader import gguf_tensors
from pagellm_gguf.tensor_slices import GGUFTensor

DEQUANTIZE_ENV = "PAGELLM_GGUF_DEQUANTIZE"


class GGUFModelFormat(ModelFormat):
    name: ClassVar[str] = "gguf"

    @classmethod
    def hf_directory(cls, path: str) -> str:
        return gguf_hf_dir(path)

    @classmethod
    def iterate_weights(
        cls, path: str, dtype: torch.dtype, quant_config: QuantizationConfig | None
    ) -> Iterator[tuple[str, GGUFTensor]]:
        # Read when indexed: a tensor-parallel rank reads only its rows or blocks of columns.
        return gguf_tensors(path, dtype, keep_quantized=isinstance(quant_config, GGUFConfig))

    @classmethod
    def default_quantization(cls, path: str, device_type: str, dtype: torch.dtype) -> str | None:
        # On the CPU there are no kernels for the blocks, and its matmul needs float weights.
        # PAGELLM_GGUF_DEQUANTIZE=1 loads float weights on a GPU too (the baseline to compare).
        if os.environ.get(DEQUANTIZE_ENV) == "1":
            return None
        return GGUFConfig.name if GGUFConfig.platform_refusal(device_type, dtype) is None else None
