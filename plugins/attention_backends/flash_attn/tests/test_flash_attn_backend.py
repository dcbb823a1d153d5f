"""FLASH_ATTN on the CPU: the reasons it gives without a usable FlashAttention build, the kernel
it picks per phase, the arrays its builder hands each build, CUDA-graph padding, greedy tokens
through the engine, and its registration.

The FlashAttention builds need a GPU, so they are replaced by the fakes of `fake_providers`
(modules under the real names, with the real signatures, computing in torch), and the GPU's
compute capability is given. TRITON, the decode kernel, is the real one, in Triton's
interpreter (conftest sets ``TRITON_INTERPRET=1`` on a machine without CUDA).
"""

from __future__ import annotations

import importlib.metadata
import json
import random
import subprocess
import sys

import fake_providers
import pytest
import torch
from fake_providers import Recorder, install
from paged_steps import Step, assert_new_kv_written, make_step, reference
from pagellm_flash_attn import backend as backend_module
from pagellm_flash_attn import builder as builder_module
from pagellm_flash_attn.backend import FlashAttnBackend
from pagellm_flash_attn.builder import FlashAttnMetadataBuilder, startup_line
from pagellm_flash_attn.kernels import FA4Kernel, TritonDecodeKernel, fa4
from pagellm_flash_attn.measurements import Measurement
from pagellm_flash_attn.phases import DECODE_VAR, PREFILL_VAR, NoFlashKernel, choose_phases

from pagellm import LLM, SamplingParams
from pagellm.attention.backend import CommonAttentionMetadata
from pagellm.attention.registry import attention_backends
from pagellm.kv_cache.spec import KVCacheSpec

H200 = (9, 0)
BF16_TOL = 3e-2
# Empty splits and padding rows take log2(0) = -inf on purpose; NumPy (the interpreter) warns.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2")


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch):
    """Pretend the current GPU has the compute capability the test sets (None: no GPU)."""
    state = {"capability": H200}

    def capability(device: torch.device | None = None) -> tuple[int, int] | None:
        return state["capability"]

    monkeypatch.setattr(backend_module, "gpu_capability", capability)
    monkeypatch.setattr(builder_module, "gpu_capability", capability)
    monkeypatch.delenv(PREFILL_VAR, raising=False)
    monkeypatch.delenv(DECODE_VAR, raising=False)
    return state


def reasons(**overrides) -> list[str]:
    query = dict(
        device_type="cuda", head_size=128, dtype=torch.bfloat16, block_size=None,
        sliding_window=None,
    )  # fmt: skip
    return FlashAttnBackend.unsupported_reasons(**{**query, **overrides})


# ---------------------------------------------------------------------------- availability


def test_without_any_build_every_providers_reason_is_given(monkeypatch, gpu):
    install(monkeypatch, {"FA4": None, "FA3": None, "FA2": None})
    why = FlashAttnBackend.is_available()
    assert why is not None and why.startswith("no FlashAttention build imports here")
    assert "FA4: flash-attn-4 is not installed (pip install 'pagellm-flash-attn[fa4]')" in why
    assert "FA3: vLLM is not installed" in why
    assert "FA2: flash-attn 2.x is not installed" in why
    assert reasons() == [why]


def test_too_old_builds_are_refused_with_their_versions(monkeypatch, gpu):
    install(monkeypatch, {"FA4": "4.0.0b20", "FA3": "0.24.2", "FA2": "2.5.9"})
    why = FlashAttnBackend.is_available()
    assert "flash-attn-4 4.0.0b20 is too old (needs >= 4.0.0b36)" in why
    assert "vLLM 0.24.2 is too old (needs >= 0.25)" in why
    assert "flash-attn 2.5.9 is not 2.x from 2.6 on" in why


def test_the_gpu_must_be_one_an_importable_build_runs_on(monkeypatch, gpu):
    install(monkeypatch, {"FA4": "4.0.0b36", "FA3": None, "FA2": None})
    assert FlashAttnBackend.is_available() is None
    gpu["capability"] = (8, 0)
    assert FlashAttnBackend.is_available() == (
        "FA4 runs on sm_90 and sm_100 (compute capability 9.x, 10.x), not sm_80"
    )
    gpu["capability"] = None
    assert FlashAttnBackend.is_available() == "no CUDA GPU is visible"


def test_head_size_block_size_and_dtype_reasons(monkeypatch, gpu):
    install(monkeypatch, {"FA4": "4.0.0b36", "FA3": None, "FA2": None})
    assert reasons() == [] and reasons(head_size=256, sliding_window=4096) == []
    (why,) = reasons(head_size=100)  # every build's reason, the uninstalled ones' too
    assert why.startswith("FA4 on sm_90 takes head sizes 8..256 in multiples of 8, not 100; FA3:")
    gpu["capability"] = (10, 0)
    assert reasons(head_size=192)[0].startswith("FA4 on sm_100 takes head sizes 8..128")
    assert reasons(dtype=torch.float32, block_size=24) == [
        "dtype float32 not supported (supports ['float16', 'bfloat16'])",
        "block_size 24 not supported (supports multiples of 16)",
    ]


def test_fa2_takes_pages_of_256_tokens_only(monkeypatch, gpu):
    install(monkeypatch, {"FA4": None, "FA3": None, "FA2": "2.8.3"})
    gpu["capability"] = (8, 0)
    assert FlashAttnBackend.is_available() is None
    (why,) = reasons()
    assert (
        "FA2's paged KV takes block sizes in multiples of 256, not 16 (pass --block-size 256)"
        in why
    )
    assert reasons(block_size=512) == []


# ---------------------------------------------------------------------------- phases


def test_each_phase_takes_the_kernel_measured_fastest(monkeypatch, gpu):
    install(monkeypatch, {"FA4": "4.0.0b36", "FA3": "0.25.1", "FA2": None})
    choice = choose_phases(H200, 128, 16)
    assert (choice.prefill.name, choice.decode.name) == ("FA4", "TRITON")
    assert choice.prefill_why == "559 TFLOP/s measured on sm_90 at block size 16; FA3 557"
    assert choice.decode_why == (
        "4,233 GB/s measured on sm_90 at block size 16; FA3 3,851, FA4 2,875"
    )
    choice = choose_phases(H200, 128, 128)
    assert (choice.prefill.name, choice.decode.name) == ("FA4", "TRITON")
    assert choice.prefill_why == "617 TFLOP/s measured on sm_90 at block size 128; FA3 598"
    # At 64-token pages nothing is measured: the first provider serves both phases.
    choice = choose_phases(H200, 128, 64)
    assert (choice.prefill.name, choice.decode.name) == ("FA4", "FA4")
    table = [
        Measurement("FA4", "decode", H200, 128, 3800.0, "test"),
        Measurement("FA4", "decode", H200, None, 9999.0, "test: overridden by the exact entry"),
        Measurement("TRITON", "decode", H200, None, 3000.0, "test"),
    ]
    choice = choose_phases(H200, 128, 128, measurements=table)
    assert (choice.prefill.name, choice.decode.name) == ("FA4", "FA4")
    assert choice.prefill_why == "no prefill measurement on sm_90 at block size 128"
    # Nothing measured on this GPU: the first provider serves both phases.
    choice = choose_phases((10, 0), 128, 16)
    assert (choice.prefill, choice.decode) == (FA4Kernel, FA4Kernel)
    assert "FA3 runs on sm_90 (compute capability 9.x) only, not sm_100" in choice.passed_over


def test_environment_overrides_the_choice_and_says_when_it_cannot(monkeypatch, gpu):
    install(monkeypatch, {"FA4": "4.0.0b36", "FA3": None, "FA2": None})
    monkeypatch.setenv(DECODE_VAR, "fa4")
    choice = choose_phases(H200, 128, 16)
    assert (choice.decode, choice.decode_why) == (FA4Kernel, f"set by {DECODE_VAR}")
    monkeypatch.setenv(PREFILL_VAR, "TRITON")
    with pytest.raises(NoFlashKernel, match="cannot serve prefill here; usable: \\['FA4'\\]"):
        choose_phases(H200, 128, 16)
    assert reasons() == [f"{PREFILL_VAR}=TRITON cannot serve prefill here; usable: ['FA4']"]


def test_startup_line_names_each_phases_kernel_and_why(monkeypatch, gpu):
    install(monkeypatch, {"FA4": "4.0.0b36", "FA3": None, "FA2": None})
    line = startup_line(choose_phases(H200, 128, 16), H200, 16)
    assert line.startswith(
        "FLASH_ATTN on sm_90, block size 16: prefill and mixed steps by FA4 (flash-attn-4 "
        "4.0.0b36) [559 TFLOP/s measured on sm_90 at block size 16]; decode steps by TRITON "
        "(pagellm-triton-attn 0.1.0, split-KV) [4,233 GB/s measured on sm_90 at block size 16; "
        "FA4 2,875]; in mixed "
        "steps with 16+ decode rows, TRITON serves those; not used: FA3: vLLM is not installed"
    )


# ---------------------------------------------------------------------------- builder and layer


def spec_for(step: Step, window: int | None = None) -> KVCacheSpec:
    _, _, block_size, num_kv_heads, head_size = step.kv_cache.shape
    return KVCacheSpec(block_size, num_kv_heads, head_size, step.kv_cache.dtype, window)


def make_impl(step: Step, window: int | None = None):
    num_heads, head_size = step.query.shape[1:]
    impl_cls = FlashAttnBackend.get_impl_cls()
    return impl_cls(num_heads, head_size, head_size**-0.5, step.kv_cache.shape[3], window)


def run_layer(
    step: Step, builder, window: int | None = None, meta=None, output: torch.Tensor | None = None
) -> torch.Tensor:
    """One attention layer over ``step``, checked against the reference; with ``output`` (a
    piecewise graph's buffer, possibly longer than the step), the result must be written there."""
    impl = make_impl(step, window)
    meta = meta or builder.build(step.common())
    if output is None:
        out = impl.forward(*step.flat(), step.kv_cache, meta)
    else:
        out = impl.forward(*step.flat(), step.kv_cache, meta, output=output)
        assert out is output
        out = out[: step.query.shape[0]]
    assert_new_kv_written(step)
    out = out.view(step.query.shape)
    assert torch.isfinite(out).all(), "some outputs were never written"
    expected = reference(step, impl.scale, window)
    torch.testing.assert_close(out.double(), expected, atol=BF16_TOL, rtol=BF16_TOL)
    return out


KW = dict(num_heads=4, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)


def test_fa4_gets_the_runners_arrays_and_serves_prefill_and_mixed_steps(monkeypatch, gpu):
    recorder = install(monkeypatch, {"FA4": "4.0.0b36", "FA3": None, "FA2": None})
    monkeypatch.setenv(DECODE_VAR, "FA4")
    step = make_step([(40, 9), (90, 1), (0, 5), (17, 1)], **KW)
    builder = FlashAttnMetadataBuilder(spec_for(step, window=24), torch.device("cpu"))
    meta = builder.build(step.common())
    assert (meta.prefill_kernel, meta.decode_kernel) == (builder.prefill_kernel, None)
    run_layer(step, builder, window=24, meta=meta)
    (call,) = recorder.calls
    assert call["cu_seqlens_q"] is step.query_start_loc and call["seqused_k"] is step.seq_lens
    assert call["page_table"] is step.block_table and call["seqused_q"] is None
    assert (call["max_seqlen_q"], call["max_seqlen_k"], call["causal"]) == (9, 91, True)
    assert (call["window_size"], call["num_splits"]) == ((23, 0), 1)  # no split-KV on sm_90

    decodes = make_step([(400, 1), (90, 1)], **KW, seed=3)
    run_layer(decodes, builder)
    call = recorder.calls[-1]
    assert (call["max_seqlen_q"], call["window_size"]) == (1, (None, None))


def _a_later_layer(rows: list[tuple[int, int]]):
    """A step laid out as ``make_step(rows)`` (the same pages and slots) with other contents:
    what a later attention layer of that step sees."""
    layer = make_step(rows, **KW)
    layer.query.mul_(-1)
    for t in (layer.kv_cache, layer.key, layer.value, layer.keys, layer.values):
        t.mul_(2)
    return layer


def test_a_steps_later_layers_launch_the_kernel_its_first_layer_chose(monkeypatch, gpu):
    recorder = install(monkeypatch, {"FA4": "4.0.0b36", "FA3": None, "FA2": None})
    monkeypatch.setattr(FA4Kernel, "replays_layers", True)
    rows = [(40, 9), (90, 1), (0, 5)]
    first = make_step(rows, **KW)
    builder = FlashAttnMetadataBuilder(spec_for(first), torch.device("cpu"))
    meta = builder.build(first.common())
    out_first = run_layer(first, builder, meta=meta)
    out_later = run_layer(_a_later_layer(rows), builder, meta=meta)  # checked against its own
    assert (len(recorder.calls), recorder.launches) == (1, 2)
    assert builder.prefill_kernel.entry_calls == 1
    assert not torch.equal(out_first, out_later)
    run_layer(make_step(rows, **KW, seed=5), builder)  # a new step: through the entry point
    assert (len(recorder.calls), recorder.launches) == (2, 3)


def test_layers_of_other_windows_each_replay_their_own_kernel(monkeypatch, gpu):
    """Alternating windowed and full layers in one step (as some models have): each kind goes
    through FA4's entry point once, then replays its own kernel."""
    recorder = install(monkeypatch, {"FA4": "4.0.0b36", "FA3": None, "FA2": None})
    monkeypatch.setattr(FA4Kernel, "replays_layers", True)
    rows = [(40, 9), (0, 5)]
    first = make_step(rows, **KW)
    builder = FlashAttnMetadataBuilder(spec_for(first, window=24), torch.device("cpu"))
    meta = builder.build(first.common())
    for window in (24, None, 24, None):
        run_layer(_a_later_layer(rows), builder, window=window, meta=meta)
    assert (len(recorder.calls), recorder.launches) == (2, 4)


def test_a_kernel_launched_with_other_arguments_turns_replays_off(monkeypatch, gpu, caplog):
    recorder = install(monkeypatch, {"FA4": "4.0.0b36", "FA3": None, "FA2": None})
    monkeypatch.setattr(FA4Kernel, "replays_layers", True)
    monkeypatch.setattr(fa4, "_OUT", 4)  # where the fake passes lse (None), not the output
    rows = [(40, 9), (0, 5)]
    first = make_step(rows, **KW)
    builder = FlashAttnMetadataBuilder(spec_for(first), torch.device("cpu"))
    meta = builder.build(first.common())
    with caplog.at_level("WARNING", logger="pagellm_flash_attn"):
        run_layer(first, builder, meta=meta)
    assert "laid out otherwise" in caplog.text and not FA4Kernel.replays_layers
    run_layer(_a_later_layer(rows), builder, meta=meta)
    assert (len(recorder.calls), recorder.launches) == (2, 2)


def test_mixed_steps_leave_decode_rows_to_triton_once_there_are_enough(monkeypatch, gpu):
    recorder = install(monkeypatch, {"FA4": "4.0.0b36", "FA3": None, "FA2": None})
    step = make_step([(40, 3), (90, 1), (0, 4), (17, 1)], **KW)
    builder = FlashAttnMetadataBuilder(spec_for(step), torch.device("cpu"))
    assert isinstance(builder.decode_kernel, TritonDecodeKernel) and builder.decodes_apart
    meta = builder.build(step.common())  # 2 decode rows, fewer than min_decodes_apart
    assert meta.decode_kernel is None and meta.prefill_query_lens is None
    run_layer(step, builder, meta=meta)

    monkeypatch.setattr(FlashAttnMetadataBuilder, "min_decodes_apart", 2)
    meta = builder.build(step.common())
    assert meta.decode_kernel is builder.decode_kernel
    assert meta.prefill_query_lens.tolist() == [3, 0, 4, 0]
    assert meta.prefill_query_lens.dtype == torch.int32
    run_layer(step, builder, meta=meta)
    assert recorder.calls[-1]["seqused_q"] is meta.prefill_query_lens


def test_triton_splits_long_decode_rows(monkeypatch, gpu):
    recorder = install(monkeypatch, {"FA4": "4.0.0b36", "FA3": None, "FA2": None})
    step = make_step([(600, 1), (33, 1), (250, 1)], **KW)
    builder = FlashAttnMetadataBuilder(spec_for(step), torch.device("cpu"))
    # 3 rows x 2 KV heads = 6 programs, more than the 4 the interpreter's "one SM" wants: no
    # split; with 16 programs an SM, 2 (the longest row, 601 keys, makes 2 shares of 256).
    assert builder.build(step.common()).decode_plan.num_splits == 1
    monkeypatch.setattr(
        builder.decode_kernel.lib.backend.TritonAttentionMetadataBuilder, "programs_per_sm", 16
    )
    meta = builder.build(step.common())
    assert meta.prefill_kernel is None and meta.decode_plan.num_splits == 2
    run_layer(step, builder, meta=meta)
    assert recorder.calls == []  # FA4 is not called in decode steps


def test_fa3_serves_every_row_and_writes_into_its_output(monkeypatch, gpu):
    recorder = install(monkeypatch, {"FA4": None, "FA3": "0.25.1", "FA2": None})
    monkeypatch.setenv(DECODE_VAR, "FA3")
    step = make_step([(40, 9), (90, 1), (0, 5), (17, 1), (3, 1)], **KW)
    builder = FlashAttnMetadataBuilder(spec_for(step), torch.device("cpu"))
    monkeypatch.setattr(FlashAttnMetadataBuilder, "min_decodes_apart", 1)
    assert not builder.decodes_apart
    out = run_layer(step, builder)
    (call,) = recorder.calls
    assert call["out"].data_ptr() == out.data_ptr()
    assert (call["fa_version"], call["num_splits"], call["window_size"]) == (3, 0, None)


def test_fa2_gets_cumulative_key_lengths_and_decodes_through_the_kvcache_entry(monkeypatch, gpu):
    recorder = install(monkeypatch, {"FA4": None, "FA3": None, "FA2": "2.8.3"})
    gpu["capability"] = (8, 0)
    step = make_step([(300, 9), (90, 1), (0, 5)], **KW, block_size=256)
    builder = FlashAttnMetadataBuilder(spec_for(step, window=100), torch.device("cpu"))
    meta = builder.build(step.common())
    assert meta.prefill_plan.tolist() == [0, 309, 400, 405]
    assert meta.prefill_plan.dtype == torch.int32
    run_layer(step, builder, window=100, meta=meta)
    assert recorder.calls[-1]["entry"] == "varlen"
    assert recorder.calls[-1]["window_size"] == (99, 0)
    decodes = make_step([(300, 1), (7, 1)], **KW, block_size=256, seed=2)
    run_layer(decodes, builder)
    call = recorder.calls[-1]
    assert call["entry"] == "kvcache" and call["q"].shape == (2, 1, 4, 32)
    assert call["cache_seqlens"] is decodes.seq_lens and call["num_splits"] == 0


def test_graph_metadata_over_persistent_buffers_replays_new_contents(monkeypatch, gpu):
    """Capture-and-replay without a GPU: graph metadata built once over persistent buffers
    (padding rows included), the buffers rewritten in place, the same metadata each time."""
    install(monkeypatch, {"FA4": "4.0.0b36", "FA3": None, "FA2": None})
    first = make_step([(300, 1), (17, 1), (64, 1)], seed=1, padding_rows=2, **KW)
    second = make_step([(5, 1), (260, 1), (130, 1)], seed=2, padding_rows=2, **KW)
    max_model_len, block_size = 512, 16
    persistent = {
        "query_start_loc": first.query_start_loc.clone(),
        "seq_lens": first.seq_lens.clone(),
        "block_table": torch.zeros(first.num_reqs, max_model_len // block_size, dtype=torch.int32),
        "slot_mapping": first.slot_mapping.clone(),
    }
    common = CommonAttentionMetadata(
        num_reqs=first.num_reqs,
        num_actual_tokens=first.num_tokens,
        max_query_len=1,
        max_seq_len=max_model_len,
        query_start_loc_cpu=first.query_start_loc.clone(),
        seq_lens_cpu=first.seq_lens.clone(),
        **persistent,
    )
    builder = FlashAttnMetadataBuilder(spec_for(first), torch.device("cpu"))
    triton_builder = builder.decode_kernel.lib.backend.TritonAttentionMetadataBuilder
    monkeypatch.setattr(triton_builder, "programs_per_sm", 20)
    meta = builder.build_for_cudagraph(common)
    # 5 padded rows x 2 KV heads = 10 programs: 2 splits reach 20 (512 keys: 2 shares of 256).
    assert meta.padded_slots and meta.decode_plan.num_splits == 2
    assert builder.build_for_cudagraph(common).decode_plan.scratch is meta.decode_plan.scratch
    impl = make_impl(first)
    for step in (first, second, first):
        for name, tensor in persistent.items():
            tensor.zero_()
            tensor[..., : getattr(step, name).shape[-1]] = getattr(step, name)
        before = step.kv_cache.clone()
        out = impl.forward(*step.flat(), step.kv_cache, meta).view(step.query.shape)
        assert_new_kv_written(step)
        # Padding tokens wrote nothing: every slot is as it was, or one of the new tokens'.
        changed = (step.kv_cache != before) & ~before.isnan()
        assert not changed.any()
        assert step.kv_cache[:, 0].isnan().all()  # the null block, untouched
        torch.testing.assert_close(
            out.double(), reference(step, impl.scale, None), atol=BF16_TOL, rtol=BF16_TOL
        )
        assert torch.equal(out[-2:], torch.zeros_like(out[-2:])), "padding rows give zeros"


def test_fa4_compiles_are_logged_with_their_time(monkeypatch, gpu, caplog):
    install(monkeypatch, {"FA4": "4.0.0b36", "FA3": None, "FA2": None})
    monkeypatch.setenv(DECODE_VAR, "FA4")
    step = make_step([(40, 9), (90, 1)], **KW)
    builder = FlashAttnMetadataBuilder(spec_for(step), torch.device("cpu"))
    with caplog.at_level("INFO", logger="pagellm_flash_attn"):
        run_layer(step, builder)
        run_layer(make_step([(41, 9), (91, 1)], **KW, seed=4), builder)  # the same variant
    compiles = [r.getMessage() for r in caplog.records if "FA4 compiled" in r.getMessage()]
    assert len(compiles) == 1, compiles
    assert compiles[0].startswith(
        "FLASH_ATTN: FA4 compiled 1 kernel(s) for a step of 2 rows, up to 9 query tokens in "
    )
    assert "(1 compiled, 0 loaded so far" in compiles[0]


# ---------------------------------------------------------------------------- engine


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def shared_prefix_prompts() -> list[list[int]]:
    rng = random.Random(3)
    prefix = [rng.randrange(3, 1000) for _ in range(35)]
    return [prefix + [rng.randrange(3, 1000) for _ in range(n)] for n in (2, 9, 30)]


def greedy_tokens(model: str, backend_name: str, passes: int = 1) -> tuple[list, LLM]:
    llm = LLM(
        model,
        max_model_len=128,
        kv_cache_memory=4 << 20,
        max_num_batched_tokens=32,  # prompts are chunked
        enable_prefix_caching=True,
        attention_backend=backend_name,
    )
    results = [
        [
            o.outputs[0].token_ids
            for o in llm.generate(shared_prefix_prompts(), GREEDY, use_tqdm=False)
        ]
        for _ in range(passes)
    ]
    return results, llm


@pytest.mark.parametrize("kind", ["llama3", "mistral"])  # mistral: sliding window 8
def test_greedy_outputs_match_torch_sdpa_with_chunks_and_prefix_hits(
    tiny_models, monkeypatch, gpu, kind
):
    """The engine on the CPU platform with FLASH_ATTN allowed there and float32 let through
    (the fake FA4 computes in float64 either way): the same tokens as TORCH_SDPA."""
    recorder = install(
        monkeypatch, {"FA4": "4.0.0b36", "FA3": None, "FA2": None}, Recorder(allow_float32=True)
    )
    monkeypatch.setattr(FlashAttnBackend, "supported_device_types", ("cuda", "cpu"))
    monkeypatch.setattr(
        FlashAttnBackend, "supported_dtypes", (torch.float16, torch.bfloat16, torch.float32)
    )
    monkeypatch.setattr(FlashAttnMetadataBuilder, "min_decodes_apart", 1)
    metas = []
    build = FlashAttnMetadataBuilder.build

    def recording_build(self, common):
        metas.append(build(self, common))
        return metas[-1]

    monkeypatch.setattr(FlashAttnMetadataBuilder, "build", recording_build)
    expected, _ = greedy_tokens(tiny_models[kind], "TORCH_SDPA")
    (first, second), llm = greedy_tokens(tiny_models[kind], "FLASH_ATTN", passes=2)
    assert llm.llm_engine.config.attention_backend == "FLASH_ATTN"
    assert first == expected[0] and second == expected[0]
    assert llm.llm_engine.engine_core.kv_cache_manager.prefix_cache_stats.hits > 0
    assert any(m.prefill_query_lens is not None for m in metas)  # decode rows apart
    assert any(m.prefill_kernel is None for m in metas)  # decode-only steps on TRITON
    assert any(c["seqused_q"] is not None for c in recorder.calls)


# ---------------------------------------------------------------------------- registration


def test_the_entry_point_registers_flash_attn():
    (entry,) = [
        e
        for e in importlib.metadata.entry_points(group="pagellm.attention_backends")
        if e.value == "pagellm_flash_attn.plugin"
    ]
    assert entry.dist is not None and entry.dist.name == "pagellm-flash-attn"
    assert attention_backends.get("FLASH_ATTN") is FlashAttnBackend
    assert FlashAttnBackend.get_kv_cache_shape(10, 16, 8, 128) == (2, 10, 16, 8, 128)
    assert FlashAttnBackend.cudagraph_support
    cli = (
        "import sys; from pagellm.entrypoints.cli import main; raise SystemExit(main(sys.argv[1:]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", cli, "plugins", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    records = {r["name"]: r for r in json.loads(proc.stdout)["pagellm.attention_backends"]}
    assert records["flash_attn"]["status"] == "loaded"
    assert records["flash_attn"]["distribution"] == "pagellm-flash-attn"


def _buffer(step: Step, extra_rows: int = 3) -> torch.Tensor:
    """A piecewise graph's output buffer for ``step``: padded past its tokens, poisoned."""
    tokens, heads, size = step.query.shape
    return torch.full((tokens + extra_rows, heads * size), float("nan"), dtype=step.query.dtype)


def test_every_kernel_writes_into_a_piecewise_graphs_buffer(monkeypatch, gpu):
    """Given the output buffer, the layer's result lands there, whether the kernel writes into
    it (FA4's replays, FA3, TRITON's decode rows) or its own result is copied (FA4's entry
    call, FA2); the padding rows past the step are left alone."""
    assert FlashAttnBackend.get_impl_cls().writes_into_output
    recorder = install(monkeypatch, {"FA4": "4.0.0b36", "FA3": None, "FA2": None})
    monkeypatch.setattr(FA4Kernel, "replays_layers", True)
    monkeypatch.setattr(FlashAttnMetadataBuilder, "min_decodes_apart", 2)
    rows = [(40, 3), (90, 1), (0, 4), (17, 1)]
    first = make_step(rows, **KW)
    builder = FlashAttnMetadataBuilder(spec_for(first), torch.device("cpu"))
    meta = builder.build(first.common())
    assert meta.decode_kernel is builder.decode_kernel  # FA4, then TRITON for the decode rows
    for step in (first, _a_later_layer(rows)):
        buffer = _buffer(step)
        run_layer(step, builder, meta=meta, output=buffer)
        assert torch.isnan(buffer[step.query.shape[0] :]).all()
    assert (len(recorder.calls), recorder.launches) == (1, 2)
    # The replayed launch wrote into the buffer itself, not into a tensor copied there.
    assert recorder.last_out is not None and recorder.last_out.data_ptr() == buffer.data_ptr()

    decodes = make_step([(400, 1), (90, 1)], **KW, seed=3)  # TRITON's decode-only step
    run_layer(decodes, builder, output=_buffer(decodes))

    install(monkeypatch, {"FA4": None, "FA3": "0.25.1", "FA2": None})
    builder = FlashAttnMetadataBuilder(spec_for(first), torch.device("cpu"))
    run_layer(first, builder, output=_buffer(first))

    install(monkeypatch, {"FA4": None, "FA3": None, "FA2": "2.8.3"})
    gpu["capability"] = (8, 0)
    paged256 = make_step([(300, 9), (90, 1), (0, 5)], **KW, block_size=256)
    builder = FlashAttnMetadataBuilder(spec_for(paged256), torch.device("cpu"))
    run_layer(paged256, builder, output=_buffer(paged256))


def test_fa4_reads_the_query_in_place_from_the_fused_projection(monkeypatch, gpu):
    """The model's q is a column slice of one [tokens, q + k + v] buffer: an aligned layout
    that FA4 reads as it is, in its entry call and in the step's replayed launches."""
    recorder = install(monkeypatch, {"FA4": "4.0.0b36", "FA3": None, "FA2": None})
    monkeypatch.setattr(FA4Kernel, "replays_layers", True)
    rows = [(40, 9), (0, 5)]
    builder = FlashAttnMetadataBuilder(spec_for(make_step(rows, **KW)), torch.device("cpu"))
    meta = builder.build(make_step(rows, **KW).common())
    for step in (make_step(rows, **KW), _a_later_layer(rows)):
        query, key, value = step.flat()
        qkv = torch.cat([query, key, value], dim=1)
        q_width, kv_width = query.shape[1], key.shape[1]
        q_view = qkv[:, :q_width]
        k_view = qkv[:, q_width : q_width + kv_width]
        v_view = qkv[:, q_width + kv_width :]
        impl = make_impl(step)
        out = impl.forward(q_view, k_view, v_view, step.kv_cache, meta)
        torch.testing.assert_close(
            out.view(step.query.shape).double(),
            reference(step, impl.scale, None),
            atol=BF16_TOL,
            rtol=BF16_TOL,
        )
    (call,) = recorder.calls  # the second layer replayed the first one's kernel
    assert call["q"].data_ptr() != query.data_ptr() and not call["q"].is_contiguous()
    assert recorder.launches == 2


def test_an_fa4_that_copies_a_strided_query_gets_a_copy_and_keeps_its_replays(monkeypatch, gpu):
    recorder = install(monkeypatch, {"FA4": "4.0.0b36", "FA3": None, "FA2": None})
    monkeypatch.setattr(FA4Kernel, "replays_layers", True)
    monkeypatch.setattr(FA4Kernel, "reads_strided_query", True)
    monkeypatch.setattr(fake_providers, "FA4_COPIES_STRIDED_QUERY", True)
    rows = [(40, 9), (0, 5)]
    builder = FlashAttnMetadataBuilder(spec_for(make_step(rows, **KW)), torch.device("cpu"))
    meta = builder.build(make_step(rows, **KW).common())
    for _ in range(3):
        step = make_step(rows, **KW)
        query, key, value = step.flat()
        qkv = torch.cat([query, key, value], dim=1)
        q_view = qkv[:, : query.shape[1]]
        out = make_impl(step).forward(q_view, key, value, step.kv_cache, meta)
        torch.testing.assert_close(
            out.view(step.query.shape).double(),
            reference(step, make_impl(step).scale, None),
            atol=BF16_TOL,
            rtol=BF16_TOL,
        )
    assert not FA4Kernel.reads_strided_query and FA4Kernel.replays_layers
    # First call: through the entry point (which copied); second: again, with a contiguous
    # copy made here, recorded; third: replayed.
    assert (len(recorder.calls), recorder.launches) == (2, 3)
