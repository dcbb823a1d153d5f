"""Attention backends by name: the built-in one, and those of `pagellm.attention_backends` plugins
(loaded on first use, in whichever process chooses or builds a backend)."""

from __future__ import annotations

from pagellm.attention.backend import AttentionBackend
from pagellm.plugins.groups import ATTENTION
from pagellm.plugins.registry import Registry

attention_backends: Registry[AttentionBackend] = Registry(
    "Attention backend", AttentionBackend, ATTENTION, named=True
)
# The built-in reference backend goes through the same registry as the plugins' backends.
attention_backends.register("TORCH_SDPA", "pagellm.attention.backends.torch_sdpa:TorchSDPABackend")
