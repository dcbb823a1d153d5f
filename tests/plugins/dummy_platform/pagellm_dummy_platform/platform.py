"""A platform that runs on the CPU under another name and prefers the DUMMY_ATTN backend."""

from pagellm.platforms.cpu import CpuPlatform


class DummyPlatform(CpuPlatform):
    name = "dummy"

    @classmethod
    def attention_backend_ranking(cls) -> list[str]:
        return ["DUMMY_ATTN", "TORCH_SDPA"]


class DummyPlatformB(CpuPlatform):
    name = "dummy_b"
