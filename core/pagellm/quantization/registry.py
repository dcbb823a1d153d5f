"""Quantization methods by name (what ``--quantization`` takes); plugins add theirs here."""

from __future__ import annotations

from pagellm.plugins.groups import QUANTIZATION
from pagellm.plugins.registry import Registry
from pagellm.quantization.base import QuantizationConfig

quantization_methods: Registry[QuantizationConfig] = Registry(
    "Quantization method", QuantizationConfig, QUANTIZATION
)
