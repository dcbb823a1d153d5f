"""The reference attention under another name, declaring narrower capabilities than it has, so
selection rules (block size, head size, sliding window) can be seen at work."""

from pagellm.attention.backends.torch_sdpa import TorchSDPABackend


class DummyAttentionBackend(TorchSDPABackend):
    name = "DUMMY_ATTN"
    block_size_multiple = 32
    default_block_size = 32
    supported_head_sizes = (16, 32, 64, 128)
    supports_sliding_window = False
