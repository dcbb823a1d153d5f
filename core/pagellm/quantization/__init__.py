from pagellm.quantization.base import (
    InputQuantizer,
    LayerSplit,
    LinearMethodBase,
    ParallelKind,
    QuantizationConfig,
    QuantizedActivation,
    TensorSplit,
)
from pagellm.quantization.unquantized import UnquantizedLinearMethod

__all__ = [
    "InputQuantizer",
    "LayerSplit",
    "LinearMethodBase",
    "ParallelKind",
    "QuantizationConfig",
    "QuantizedActivation",
    "TensorSplit",
    "UnquantizedLinearMethod",
]
