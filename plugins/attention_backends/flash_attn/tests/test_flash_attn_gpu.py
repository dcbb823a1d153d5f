"""FLASH_ATTN on a CUDA GPU, with each FlashAttention build that imports here (FA4, FA3, FA2)
and the TRITON decode kernel: prefill, chunks after cached context and mixed steps (every row in
one kernel, and decode rows apart), decode of 256 rows with graph padding rows, partial last
pages, head sizes 64/128/256, GQA, sliding windows, against a float32 torch reference; a CUDA
graph replay bit-identical to the same metadata run eagerly; and the engine's greedy tokens
against TRITON_ATTN's, with no FA4 kernel compiled after the start-up warm-up.

Run on the GPU machine with ``pytest -m gpu plugins/attention_backends/flash_attn/tests``; a
build that does not import is skipped with its reason.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from paged_steps import Step, assert_new_kv_written, make_step, reference
from pagellm_flash_attn.backend import FlashAttnBackend
from pagellm_flash_attn.builder import FlashAttnMetadataBuilder
from pagellm_flash_attn.kernels import KERNELS, PROVIDERS, FA4Kernel
from pagellm_flash_attn.phases import DECODE_VAR, PREFILL_VAR

from pagellm.attention.backend import CommonAttentionMetadata
from pagellm.kv_cache.spec import KVCacheSpec
from pagellm.testing.greedy import count_identical_with_near_ties, greedy_run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 would not compile"
    ),
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Against float32: the kernels round probabilities to the input dtype before P @ V.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3}
# (dtype, head size, query heads, KV heads, sliding window): Qwen3-0.6B, Llama-3.1-8B, and more.
CONFIGS = [
    ("bf16", 128, 16, 8, None),
    ("fp16", 64, 32, 8, 1000),
    ("bf16", 256, 8, 4, 4096),
]
# (prefill kernel, decode kernel, block size): each build alone, FA4 with pages of a whole key
# tile (128: its TMA path) too, and FA4 with TRITON taking the decode rows.
PAIRS = [
    ("FA4", "FA4", 16),
    ("FA4", "FA4", 128),
    ("FA4", "TRITON", 16),
    ("FA4", "TRITON", 128),
    ("FA3", "FA3", 16),
    ("FA2", "FA2", 256),
]
DECODERS = [
    ("FA4", 16),
    ("FA4", 128),
    ("TRITON", 16),
    ("TRITON", 128),
    ("FA3", 16),
    ("FA2", 256),
]


@pytest.fixture(autouse=True)
def exact_float32_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    # The reference must not run its float32 matmuls in TF32.
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def builder_for(
    monkeypatch: pytest.MonkeyPatch,
    prefill: str,
    decode: str,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    window: int | None,
) -> FlashAttnMetadataBuilder:
    """The backend's builder with its kernels forced; skips when one cannot run here."""
    capability = torch.cuda.get_device_capability()
    for name in {prefill, decode}:
        kernel = KERNELS[name]
        why = kernel.unavailable_reason() or kernel.unsupported_gpu(capability)
        why = why or next(iter(kernel.unsupported_shape(capability, head_size, block_size)), None)
        if why:
            pytest.skip(why)
    monkeypatch.setenv(PREFILL_VAR, prefill)
    monkeypatch.setenv(DECODE_VAR, decode)
    spec = KVCacheSpec(block_size, num_kv_heads, head_size, dtype, window)
    return FlashAttnMetadataBuilder(spec, torch.device("cuda"))


def prefill_for(decode: str, block_size: int, head_size: int) -> str:
    """The kernel that serves the prefill steps next to ``decode``: itself when it can, else
    the first FlashAttention build that runs here."""
    if KERNELS[decode].serves_prefill:
        return decode
    capability = torch.cuda.get_device_capability()
    for kernel in PROVIDERS:
        usable = not (kernel.unavailable_reason() or kernel.unsupported_gpu(capability))
        if usable and not kernel.unsupported_shape(capability, head_size, block_size):
            return kernel.name
    pytest.skip("no FlashAttention build runs here")


def impl_for(step: Step, window: int | None):
    num_heads, head_size = step.query.shape[1:]
    impl_cls = FlashAttnBackend.get_impl_cls()
    return impl_cls(num_heads, head_size, head_size**-0.5, step.kv_cache.shape[3], window)


def assert_matches_reference(out: torch.Tensor, step: Step, scale: float, window: int | None):
    out = out.view(step.query.shape)
    num_real = out.shape[0] - step.num_padding
    assert torch.isfinite(out[:num_real]).all(), "some outputs were never written, or read poison"
    assert torch.isfinite(out[num_real:]).all(), "padding rows' outputs are not finite"
    tol = TOLERANCE[step.query.dtype]
    torch.testing.assert_close(out.float(), reference(step, scale, window), atol=tol, rtol=tol)


def random_decode_rows(n: int, max_context: int, seed: int) -> list[tuple[int, int]]:
    gen = torch.Generator().manual_seed(seed)
    return [(int(c), 1) for c in torch.randint(0, max_context, (n,), generator=gen)]


@pytest.mark.parametrize("dtype, head_size, num_heads, num_kv_heads, window", CONFIGS)
@pytest.mark.parametrize("prefill, decode, block_size", PAIRS)
def test_prefill_chunks_and_mixed_steps_match_reference(
    monkeypatch, prefill, decode, block_size, dtype, head_size, num_heads, num_kv_heads, window
):
    """A prompt, chunks after long cached contexts, short rows and 200 decodes in one step; the
    lengths leave most rows' last page partly used."""
    builder = builder_for(
        monkeypatch, prefill, decode, block_size, num_kv_heads, head_size, DTYPES[dtype], window
    )
    rows = [(0, 2048), (3000, 512), (6900, 1200), (0, 37), (129, 64), (8000, 1)]
    rows += random_decode_rows(200, 8192, seed=head_size)
    kwargs = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size)
    step = make_step(
        rows, **kwargs, dtype=DTYPES[dtype], block_size=block_size, seed=num_heads, device="cuda"
    )
    impl = impl_for(step, window)
    meta = builder.build(step.common())
    assert (meta.decode_kernel is not None) == (decode != prefill)  # 201 decode rows: apart
    out = impl.forward(*step.flat(), step.kv_cache, meta)
    assert_new_kv_written(step)
    assert_matches_reference(out, step, impl.scale, window)


@pytest.mark.parametrize("dtype, head_size, num_heads, num_kv_heads, window", CONFIGS)
@pytest.mark.parametrize("decode, block_size", DECODERS)
def test_decode_of_256_rows_matches_reference(
    monkeypatch, decode, block_size, dtype, head_size, num_heads, num_kv_heads, window
):
    prefill = prefill_for(decode, block_size, head_size)
    builder = builder_for(
        monkeypatch, prefill, decode, block_size, num_kv_heads, head_size, DTYPES[dtype], window
    )
    step = make_step(
        random_decode_rows(248, 8192, seed=7),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=DTYPES[dtype],
        block_size=block_size,
        padding_rows=8,
        device="cuda",
    )
    impl = impl_for(step, window)
    # Padding rows (slot -1) occur in graph replays only: the graph metadata, run eagerly.
    meta = builder.build_for_cudagraph(step.common(max_seq_len=8192))
    assert meta.prefill_kernel is None
    out = impl.forward(*step.flat(), step.kv_cache, meta).view(step.query.shape)
    assert_new_kv_written(step)
    assert_matches_reference(out, step, impl.scale, window)
    assert torch.equal(out[-8:], torch.zeros_like(out[-8:])), "padding rows must give zeros"


@pytest.mark.parametrize("decode, block_size", DECODERS)
def test_graph_replay_is_identical_to_eager(monkeypatch, decode, block_size):
    """Graph metadata over persistent buffers: run eagerly, then captured once and replayed for
    two steps written into those buffers in place; replay and eager agree bit for bit."""
    num_heads, num_kv_heads, head_size, max_model_len = 32, 8, 128, 16384
    prefill = prefill_for(decode, block_size, head_size)
    builder = builder_for(
        monkeypatch, prefill, decode, block_size, num_kv_heads, head_size, torch.bfloat16, None
    )
    kwargs = dict(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=torch.bfloat16,
        block_size=block_size,
        padding_rows=2,
        device="cuda",
    )
    steps = [make_step(random_decode_rows(6, 12000, seed=s), seed=s, **kwargs) for s in (1, 2)]
    num_rows, dev = steps[0].num_reqs, torch.device("cuda")
    qsl = torch.arange(num_rows + 1, dtype=torch.int32, device=dev)
    seq_lens = torch.zeros(num_rows, dtype=torch.int32, device=dev)
    block_table = torch.zeros(num_rows, max_model_len // block_size, dtype=torch.int32, device=dev)
    slot_mapping = torch.full((num_rows,), -1, dtype=torch.int64, device=dev)
    query = torch.zeros(num_rows, num_heads * head_size, dtype=torch.bfloat16, device=dev)
    key = torch.zeros(num_rows, num_kv_heads * head_size, dtype=torch.bfloat16, device=dev)
    value = torch.zeros_like(key)
    num_blocks = max(s.kv_cache.shape[1] for s in steps)
    kv_cache = torch.zeros(
        2, num_blocks, block_size, num_kv_heads, head_size, dtype=torch.bfloat16, device=dev
    )
    common = CommonAttentionMetadata(
        num_reqs=num_rows,
        num_actual_tokens=num_rows,
        max_query_len=1,
        max_seq_len=max_model_len,
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.cpu(),
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.cpu(),
        block_table=block_table,
        slot_mapping=slot_mapping,
    )
    meta = builder.build_for_cudagraph(common)
    impl = impl_for(steps[0], None)

    def load(step: Step) -> None:
        seq_lens.copy_(step.seq_lens)
        block_table.zero_()
        block_table[:, : step.block_table.shape[1]] = step.block_table
        slot_mapping.copy_(step.slot_mapping)
        query.copy_(step.query.reshape(num_rows, -1))
        key.copy_(step.key.reshape(num_rows, -1))
        value.copy_(step.value.reshape(num_rows, -1))
        kv_cache.zero_()
        kv_cache[:, : step.kv_cache.shape[1]] = step.kv_cache.nan_to_num(0.0)

    eager = []
    for step in steps:  # eager first: also compiles every kernel outside the capture
        load(step)
        eager.append(impl.forward(query, key, value, kv_cache, meta).clone())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = impl.forward(query, key, value, kv_cache, meta)
    for step, expected in zip(steps, eager, strict=True):
        load(step)
        graph.replay()
        assert torch.equal(out, expected), "replay differs from the same metadata run eagerly"
        assert_matches_reference(out, step, impl.scale, None)
        assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))


# ---------------------------------------------------------------------------- engine

TINY = dict(
    vocab_size=2048,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
MODELS = {
    "qwen3": dict(model_type="qwen3", head_dim=128),  # head 128, GQA 4:1
    "mistral": dict(model_type="mistral", sliding_window=128, head_dim=64),
}
NUM_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("flash_attn_models")
    paths = {}
    for kind, extra in MODELS.items():
        spec = {**TINY, **extra}
        config = AutoConfig.for_model(spec.pop("model_type"), **spec)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" not in name:
                    param.normal_(0.0, 0.05)  # peaked logits: fewer near-ties between kernels
        model.save_pretrained(Path(root) / kind)
        paths[kind] = str(Path(root) / kind)
    return paths


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    out = [rng.integers(3, 2048, n).tolist() for n in (7, 33, 150, 300, 517, 64, 1000, 260)]
    out.append(out[3][:200] + rng.integers(3, 2048, 40).tolist())  # shares a prefix
    return out


def generate(model: str, backend: str):
    from pagellm import LLM, SamplingParams

    llm = LLM(
        model,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=2048,
        max_num_batched_tokens=512,  # chunked prefill with cached context
        kv_cache_memory=1 << 30,
        attention_backend=backend,
    )
    assert llm.llm_engine.config.attention_backend == backend
    compiled_at_start = FA4Kernel._jit_log.entries() if FA4Kernel._jit_log else 0
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, logprobs=2, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    compiled_serving = (
        FA4Kernel._jit_log.entries() if FA4Kernel._jit_log else 0
    ) - compiled_at_start
    # Per position: the logprobs of the two most likely tokens (the pick among them).
    result = [greedy_run(o.outputs[0]) for o in outputs]
    del llm, outputs
    gc.collect()
    torch.cuda.empty_cache()
    return result, compiled_serving


@pytest.mark.parametrize("kind", list(MODELS))
def test_greedy_tokens_match_triton_attn_and_nothing_compiles_after_warm_up(gpu_models, kind):
    """CUDA graphs on (decode steps replayed), chunked prefill, a shared prefix. Up to the first
    token where the two backends differ their logprobs agree; at it the two picks are a near-tie
    in both runs (each backend's pick is the other's runner-up, within 0.1); after it the
    sequences are on different paths and are not compared."""
    why = FlashAttnBackend.unsupported_reasons(
        device_type="cuda",
        head_size=MODELS[kind]["head_dim"],
        dtype=torch.bfloat16,
        block_size=None,
        sliding_window=MODELS[kind].get("sliding_window"),
    )
    if why:
        pytest.skip("; ".join(why))
    flash, compiled_serving = generate(gpu_models[kind], "FLASH_ATTN")
    triton, _ = generate(gpu_models[kind], "TRITON_ATTN")
    assert compiled_serving == 0, "FA4 compiled kernels while serving, not in the warm-up"
    identical = count_identical_with_near_ties(flash, triton, 0.1, kind)
    print(f"{kind}: {identical}/{len(flash)} sequences identical to TRITON_ATTN's")
    assert identical >= 1
