from pagellm.quantization.base import LinearMethodBase, QuantizationConfig
from pagellm.quantization.unquantized import UnquantizedLinearMethod

__all__ = ["LinearMethodBase", "QuantizationConfig", "UnquantizedLinearMethod"]
