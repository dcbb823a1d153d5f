"""`PiecewiseGraphs` without a GPU: what is captured, which steps replay it, and the tokens of an
engine that replays it against an eager one. CUDA graphs cannot be recorded here, so a CPU
platform's `capture_graph` stands in for one (as in test_decode_graphs.py): its "replay" runs
the recorded segment again, which reads the static buffers at their fixed addresses just as a
graph replay does. Whether real graphs replay the same kernels is the GPU test's to check
(tests/e2e/test_gpu_piecewise.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import pagellm.platforms
from pagellm import LLM, SamplingParams
from pagellm.config import EngineConfig
from pagellm.forward_context import set_forward_context
from pagellm.platforms.cpu import CpuPlatform
from pagellm.worker.cudagraphs import DecodeGraphs
from pagellm.worker.model_runner import ModelRunner
from pagellm.worker.piecewise import PiecewiseGraphs, SegmentBuffers, _packed
from pagellm.worker.step_buffers import StepBuffers
from segment_steps import BLOCK_SIZE, STEPS, step_inputs, step_metadata


class ReplayingPlatform(CpuPlatform):
    """Records a graph by keeping its forward pass; turns (decode) graphs on as a GPU platform
    does, with no decode sizes (TORCH_SDPA cannot be captured whole)."""

    @classmethod
    def check_and_update_config(cls, config: EngineConfig) -> None:
        if not config.compilation.enforce_eager:
            config.compilation.cudagraph_mode = "decode"

    @classmethod
    def capture_graph(
        cls, forward: Callable[[], torch.Tensor], pool: object
    ) -> tuple[Callable[[], None], torch.Tensor]:
        output = forward()
        return (lambda: output.copy_(forward())), output


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)  # as RMSNorm's


def fused_add_rms_norm(x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
    residual.add_(x)
    x.copy_(_rms_norm(residual, weight, eps))
    return x, residual


def rotary_embedding(positions, q, k, head_size, cos_sin_cache) -> None:
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    for x in (q, k):  # as RotaryEmbedding's, written back into x
        x1, x2 = x.reshape(x.shape[0], -1, head_size).float().chunk(2, dim=-1)
        x.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype).view(x.shape))


class InPlaceOpsPlatform(ReplayingPlatform):
    """With torch versions of a GPU platform's fused ops that write in place (the fused add +
    norm into the residual, the rotation into q and k, views of the fused qkv output), the
    segments hand over the residual in place and q, k and v in one copy (Llama)."""

    @classmethod
    def custom_ops(cls) -> dict[str, Callable[..., Any]]:
        return {"fused_add_rms_norm": fused_add_rms_norm, "rotary_embedding": rotary_embedding}


@pytest.fixture(params=[ReplayingPlatform, InPlaceOpsPlatform], ids=["torch-ops", "in-place-ops"])
def replaying_platform(request, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pagellm.platforms, "_current", ("cpu", request.param))


def llm(model: str, **kwargs) -> LLM:
    options = dict(
        max_model_len=256,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=64,
        kv_cache_memory=16 << 20,
    )
    return LLM(model, **{**options, **kwargs})


def runner_of(engine: LLM) -> ModelRunner:
    return engine.llm_engine.engine_core.executor.worker.model_runner


# ---------------------------------------------------------------------- which steps replay what


def selecting_runner(decode_sizes: list[int], piecewise_sizes: list[int]) -> ModelRunner:
    runner = object.__new__(ModelRunner)  # only what `_graphs_for` reads
    runner.graphs = DecodeGraphs(ReplayingPlatform)
    runner.graphs.sizes = decode_sizes
    runner.graphs.captured = {s: SimpleNamespace(size=s) for s in decode_sizes}
    runner.piecewise = PiecewiseGraphs(ReplayingPlatform)
    runner.piecewise.sizes = piecewise_sizes
    return runner


def step(num_reqs: int, num_tokens: int) -> SimpleNamespace:
    return SimpleNamespace(rows=list(range(num_reqs)), num_tokens=num_tokens)


def test_steps_no_decode_graph_serves_replay_the_smallest_piecewise_size_that_holds_them():
    runner = selecting_runner([1, 2, 4], [16, 64, 256])
    graph, size = runner._graphs_for(step(3, 3), None)  # decode-only: its decode graph
    assert graph.size == 4 and size is None
    assert runner._graphs_for(step(8, 8), None) == (None, 16)  # decode beyond the decode graphs
    assert runner._graphs_for(step(2, 40), None) == (None, 64)  # mixed prefill + decode
    assert runner._graphs_for(step(1, 64), None) == (None, 64)  # a prefill that fits exactly
    assert runner._graphs_for(step(1, 16), None) == (None, 16)
    assert runner._graphs_for(step(3, 257), None) == (None, None)  # above the largest: eager


def test_steps_with_item_embeddings_always_run_eagerly():
    runner = selecting_runner([1, 2, 4], [16, 64])
    embeds = SimpleNamespace()  # a multimodal step's image rows
    assert runner._graphs_for(step(2, 2), embeds) == (None, None)
    assert runner._graphs_for(step(2, 40), embeds) == (None, None)


def test_without_piecewise_graphs_only_decode_steps_replay():
    runner = selecting_runner([1, 2, 4], [])
    assert runner._graphs_for(step(2, 40), None) == (None, None)
    assert runner._graphs_for(step(2, 2), None)[0].size == 2


def test_a_model_without_segments_is_left_eager(caplog):
    graphs = PiecewiseGraphs(ReplayingPlatform)
    buffers = StepBuffers(64, 8, 4, torch.device("cpu"), pin_memory=False)
    with caplog.at_level(logging.INFO):
        assert graphs.capture(torch.nn.Linear(2, 2), buffers, [16, 64], None) == 0.0
    assert graphs.sizes == [] and graphs.size_for(8) is None
    assert "Linear has no segmented forward pass" in caplog.text


# ---------------------------------------------------------------------- capture and replay


@pytest.mark.parametrize(
    ("platform", "kind", "packed"),
    [
        (InPlaceOpsPlatform, "llama3", True),  # q and k rotated in place in the fused output
        (InPlaceOpsPlatform, "qwen3", False),  # the per-head norms make new tensors first
        (ReplayingPlatform, "llama3", False),  # torch's rotation makes new tensors
    ],
)
@torch.inference_mode()
def test_segments_hand_over_in_place_where_the_ops_write_in_place(
    tiny_models, monkeypatch, platform, kind, packed
):
    monkeypatch.setattr(pagellm.platforms, "_current", ("cpu", platform))
    runner = runner_of(llm(tiny_models[kind], enforce_eager=True))
    decoder = runner.model.segmented_decoder()
    ids, positions = step_inputs(STEPS[0], runner.config.model.vocab_size)
    first = decoder.first_segment(ids, positions)
    assert (_packed(first) is not None) == packed
    buffers = SegmentBuffers.like(first)
    buffers.store(first, len(ids))
    assert torch.equal(buffers.q, first.q) and torch.equal(buffers.v, first.v)
    after = decoder.next_segment(1, positions, buffers.attn_output, buffers.residual)
    in_place = after.residual.data_ptr() == buffers.residual.data_ptr()
    assert in_place == (platform is InPlaceOpsPlatform)
    # The projection written into the buffer (as captured segments do): v is its slice, and
    # q and k too where the ops rotate in place, so storing them copies nothing.
    into = decoder.first_segment(ids, positions, buffers.qkv[: len(ids)])
    assert into.v.data_ptr() == buffers.v.data_ptr()
    assert (into.q.data_ptr() == buffers.qkv.data_ptr()) == packed
    assert torch.equal(into.q, first.q) and torch.equal(into.k, first.k)
    assert torch.equal(into.v, first.v)


@pytest.mark.parametrize("kind", ["llama3", "qwen3"])
@torch.inference_mode()
def test_a_replay_over_padded_buffers_is_the_eager_forward_pass(tiny_models, kind, caplog):
    """Capture over the runner's step buffers, then each step staged in them as the runner does
    (its tokens first, stale rows after them) and replayed at a larger size: the real rows'
    hidden states are the eager forward pass's, bit for bit."""
    runner = runner_of(llm(tiny_models[kind], enforce_eager=True))
    graphs = PiecewiseGraphs(ReplayingPlatform)
    with caplog.at_level(logging.INFO):
        graphs.capture(runner.model, runner.buffers, [64, 16, 32], None)
    num_layers = runner.config.model.num_layers
    assert graphs.sizes == [16, 32, 64]
    assert all(len(graphs.replays[s]) == num_layers + 1 for s in graphs.sizes)
    assert f"Captured {3 * (num_layers + 1)} piecewise CUDA graphs" in caplog.text
    inputs = runner.buffers.device_tensors
    inputs.input_ids[:64] = torch.arange(64) * 5 % 1000  # stale rows a padded step reads
    inputs.positions[:64] = torch.arange(64) * 3 % 256
    for requests in STEPS:
        ids, positions = step_inputs(requests, runner.config.model.vocab_size)
        n = len(ids)
        inputs.input_ids[:n], inputs.positions[:n] = ids, positions
        common = step_metadata(requests)
        size = graphs.size_for(n)
        assert size == 64 if n > 32 else size == 32
        hidden = graphs.run(size, n, runner.attn_builder.build(common))
        with set_forward_context(runner.attn_builder.build(common)):
            expected = runner.model(ids, positions)
        assert torch.equal(hidden, expected)


# ---------------------------------------------------------------------- the engine


PROMPTS = [
    [(7 * i + 3 * j) % 1000 + 3 for j in range(n)] for i, n in enumerate((5, 90, 40, 13, 70))
]


def generate(engine: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
    outputs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    result = []
    for output in outputs:
        tokens = list(output.outputs[0].token_ids)
        lps = [lp[t].logprob for lp, t in zip(output.outputs[0].logprobs, tokens, strict=True)]
        result.append((tokens, lps))
    return result


@pytest.mark.parametrize("kind", ["llama3", "qwen3"])
def test_piecewise_steps_give_the_eager_tokens_and_logprobs(
    tiny_models, replaying_platform, kind, caplog
):
    """Chunked prefills (64-token budget, prompts up to 90 tokens) mixed with decodes: every
    step of the piecewise engine replays piecewise graphs (there are no decode graphs here),
    and greedy tokens and logprobs are the eager engine's on the same platform (float32)."""
    eager = generate(llm(tiny_models[kind], enforce_eager=True))
    with caplog.at_level(logging.INFO):
        engine = llm(
            tiny_models[kind],
            cudagraph_mode="decode_and_piecewise",
            piecewise_capture_sizes=[8, 16, 32, 64],
        )
    assert engine.llm_engine.config.compilation.cudagraph_mode == "decode_and_piecewise"
    assert "piecewise graphs" in caplog.text.split("Engine core ready")[1].splitlines()[0]
    runner = runner_of(engine)
    assert runner.piecewise.sizes == [8, 16, 32, 64]
    sizes: list[int] = []
    replay = runner.piecewise.run

    def counting(size: int, num_tokens: int, attn_metadata) -> torch.Tensor:
        sizes.append(size)
        return replay(size, num_tokens, attn_metadata)

    runner.piecewise.run = counting
    piecewise = generate(engine)
    assert [tokens for tokens, _ in piecewise] == [tokens for tokens, _ in eager]
    for (_, ours), (_, theirs) in zip(piecewise, eager, strict=True):
        # Padding a step of 1 to 3 tokens changes how the CPU's BLAS sums them (it takes a
        # matrix-vector path for so few rows): the last bits may differ, nothing more.
        assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) <= 1e-5
    assert 64 in sizes and 8 in sizes  # full mixed steps and the last few decodes


def test_llava_text_steps_replay_and_image_steps_run_eagerly(tiny_llava, replaying_platform):
    """LLaVA's language model is segmented; a step whose tokens reach an image's rows takes
    the item embeddings as inputs and runs eagerly, every other step replays."""
    from pagellm.multimodal import MultiModalItem

    def run(**kwargs) -> tuple[list[list[int]], list[tuple[object, object]]]:
        engine = llm(tiny_llava, max_model_len=128, max_num_batched_tokens=32, **kwargs)
        runner = runner_of(engine)
        [spec] = engine.llm_engine.config.model.multimodal_specs
        image = torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(0))
        ids = [5, 6, 7] + [spec.placeholder_token_id] * spec.tokens_per_item + [8, 9] * 10
        item = MultiModalItem.from_tensor("image", image, 3, spec.tokens_per_item)
        prompts = [
            {"prompt_token_ids": ids, "multi_modal_items": [item]},
            {"prompt_token_ids": list(range(10, 50))},
        ]
        chosen: list[tuple[object, object]] = []
        select = runner._graphs_for

        def recording(plan, embeds):
            chosen.append(select(plan, embeds))
            return chosen[-1]

        runner._graphs_for = recording
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        outputs = engine.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs], chosen

    eager, _ = run(enforce_eager=True)
    tokens, chosen = run(cudagraph_mode="decode_and_piecewise", piecewise_capture_sizes=[8, 32])
    assert tokens == eager
    assert (None, None) in chosen  # the image's steps
    assert (None, 32) in chosen and (None, 8) in chosen  # text chunks, then the decodes
