"""The GGUF block types this package keeps quantized, and their sizes.

Each row of a quantized GGUF matrix is a run of blocks along the input dimension; a block of
``block_size`` weights takes ``type_size`` bytes (scales and packed integers, in llama.cpp's
layout: ggml-common.h). Other types are dequantized to float at load.
"""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

KERNEL_TYPES: tuple[GGMLQuantizationType, ...] = (
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
)
FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def block_shape(qtype: int) -> tuple[int, int]:
    """(weights per block, bytes per block) of GGUF type ``qtype``."""
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    return int(block_size), int(type_size)


def type_name(qtype: int) -> str:
    return GGMLQuantizationType(qtype).name
