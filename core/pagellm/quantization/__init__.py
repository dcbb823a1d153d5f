from pagellm.quantization.base import LinearMethodBase, QuantizationConfig
from pagellm.quantization.registry import get_quantization_config_cls, quantization_methods
from pagellm.quantization.unquantized import UnquantizedLinearMethod

__all__ = [
    "LinearMethodBase",
    "QuantizationConfig",
    "UnquantizedLinearMethod",
    "get_quantization_config_cls",
    "quantization_methods",
]
