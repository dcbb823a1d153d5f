from pagellm.quantization.base import (
    LayerSplit,
    LinearMethodBase,
    ParallelKind,
    QuantizationConfig,
    TensorSplit,
)
from pagellm.quantization.unquantized import UnquantizedLinearMethod

__all__ = [
    "LayerSplit",
    "LinearMethodBase",
    "ParallelKind",
    "QuantizationConfig",
    "TensorSplit",
    "UnquantizedLinearMethod",
]
