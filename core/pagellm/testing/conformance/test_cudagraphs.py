"""The CUDA-graph contract, where it is declared (docs/plugins.md, CUDA graphs).

A backend with ``cudagraph_support`` builds graph metadata, and decode steps replayed from it
(the padded batch rewritten in place, `prepare_cudagraph_replay` before each) match TORCH_SDPA:
recorded by the platform where it records graphs and has a device, re-run elsewhere. A platform
turns decode graphs on only with a backend that supports them and without ``--enforce-eager``,
with capture sizes it can use, and only if it records graphs; that one records and replays a
graph on its device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from pagellm.attention.backend import AttentionMetadataBuilder
from pagellm.attention.backends.torch_sdpa import TorchSDPABackend
from pagellm.attention.registry import attention_backends
from pagellm.config import EngineConfig
from pagellm.engine.args import EngineArgs
from pagellm.testing.conformance.compare import ConformanceFailure
from pagellm.testing.conformance.graphs import assert_graph_replays_match, records_graphs
from pagellm.testing.conformance.probes import default_shape
from pagellm.testing.conformance.targets import BackendTarget, PlatformTarget

MAX_NUM_SEQS = 48


def _graph_backend(backend: BackendTarget) -> type[Any]:
    cls = backend.require_class()
    if not cls.cudagraph_support:
        pytest.skip(f"{backend.name} declares cudagraph_support = False: its steps run eagerly")
    return cls


def _missing_graph_metadata(backend: BackendTarget) -> str | None:
    builder = _graph_backend(backend).get_builder_cls()
    defined_by = next(k for k in builder.__mro__ if "build_for_cudagraph" in vars(k))
    if defined_by is not AttentionMetadataBuilder:
        return None
    return (
        f"{backend.name} declares cudagraph_support = True, but {builder.__qualname__} does not "
        "implement build_for_cudagraph (AttentionMetadataBuilder's raises NotImplementedError)"
    )


def test_backend_declaring_graphs_builds_graph_metadata(backend: BackendTarget) -> None:
    missing = _missing_graph_metadata(backend)
    if missing:
        raise ConformanceFailure(missing)


def test_decode_steps_replayed_from_graph_metadata_match(backend: BackendTarget) -> None:
    missing = _missing_graph_metadata(backend)
    if missing:  # the case above fails with it
        pytest.skip(missing)
    cls = backend.skip_unless_usable()
    shape = default_shape(backend)
    assert_graph_replays_match(cls, shape, backend.device(), backend.platform_cls)


def _capable_backend(backend_names: list[str]) -> str | None:
    """A backend with graph support: one under test, else any installed."""
    for name in [*backend_names, *attention_backends.names()]:
        try:
            if attention_backends.get(name).cudagraph_support:
                return name
        except (ValueError, RuntimeError):  # not registered, or does not import
            continue
    return None


def test_platform_turns_graphs_on_only_as_declared(
    platform: PlatformTarget, tiny_llama: Callable[[int], str], request: pytest.FixtureRequest
) -> None:
    cls = platform.require_class()
    model = tiny_llama(64)

    def configured(backend_name: str, **args: Any) -> EngineConfig:
        config = EngineArgs(
            model=model,
            max_model_len=64,
            kv_cache_memory=4 << 20,
            skip_tokenizer_init=True,
            max_num_seqs=MAX_NUM_SEQS,
            **args,
        ).create_engine_config()
        config.attention_backend = backend_name
        block_size = config.cache.block_size
        try:
            cls.check_and_update_config(config)
        except Exception as exc:
            if platform.active:
                raise
            pytest.skip(
                f"{platform.inactive_reason}; its check_and_update_config needs it "
                f"({type(exc).__name__}: {exc})"
            )
        if (config.attention_backend, config.cache.block_size) != (backend_name, block_size):
            raise ConformanceFailure(
                "check_and_update_config changed the attention backend or the block size, which "
                "selection had checked together: leave them as they are"
            )
        return config

    capable = _capable_backend(request.config.getoption("pagellm_backend"))
    problems = []
    off = {
        f"backend {TorchSDPABackend.name} (cudagraph_support = False)": configured(
            TorchSDPABackend.name
        ),
        "--enforce-eager": configured(capable or TorchSDPABackend.name, enforce_eager=True),
    }
    for why, config in off.items():
        comp = config.compilation
        if comp.cudagraph_mode != "none" or comp.cudagraph_capture_sizes:
            problems.append(
                f"with {why}, check_and_update_config left cudagraph_mode {comp.cudagraph_mode!r} "
                f"and capture sizes {comp.cudagraph_capture_sizes}: graphs must stay off"
            )
    if capable is not None:
        comp = configured(capable).compilation
        sizes = comp.cudagraph_capture_sizes
        if comp.cudagraph_mode == "decode":
            if not records_graphs(cls):
                problems.append(
                    f"with backend {capable}, it turns decode graphs on, but {cls.__qualname__} "
                    "does not override capture_graph (Platform's raises)"
                )
            if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1 or sizes[-1] > MAX_NUM_SEQS:
                problems.append(
                    f"with backend {capable} and max_num_seqs {MAX_NUM_SEQS}, its capture sizes "
                    f"{sizes} are not distinct ascending sizes from 1 to max_num_seqs"
                )
        elif sizes:
            problems.append(f"graphs off, yet capture sizes {sizes}")
    if problems:
        raise ConformanceFailure(f"platform {platform.name}: " + "; ".join(problems))


def test_platform_records_and_replays_a_graph(platform: PlatformTarget) -> None:
    cls = platform.require_class()
    if not records_graphs(cls):
        pytest.skip(f"platform {platform.name} records no graphs (capture_graph is Platform's)")
    platform.require_device()
    device = cls.device(0)
    source = torch.arange(8, dtype=torch.float32, device=device)

    def forward() -> torch.Tensor:
        return source * 2 + 1

    forward()
    cls.synchronize()
    replay, output = cls.capture_graph(forward, cls.graph_pool())
    source.copy_(torch.full((8,), 5.0))
    replay()
    cls.synchronize()
    if not torch.equal(output.cpu(), torch.full((8,), 11.0)):
        raise ConformanceFailure(
            f"platform {platform.name}: a replay after rewriting the graph's input in place "
            f"gave {output.cpu().tolist()}, not 11.0 everywhere"
        )
