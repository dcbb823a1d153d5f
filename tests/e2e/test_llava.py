"""The LLaVA-style model against Hugging Face transformers' ``LlavaForConditionalGeneration`` with
the same random weights (float32, CPU): prompts with one and two images batched with text-only
ones, chunked prefill cutting through an image's placeholder span, preemption, the encoder cache,
the image hash in the KV block hashes, and items crossing both process boundaries.

Items are made here directly (`MultiModalItem.from_tensor` of a pixel tensor), as an IO
processor's ``pre_process`` makes them; decoding images is the image processor's (its own tests).

The oracle is teacher forcing: transformers scores the prompt and pagellm's output in one forward
pass; each generated token must be HF's argmax there (so greedy decoding is identical), and every
logprob pagellm reports (prompt and output, the top-k included) must be HF's within 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.executor import wire
from pagellm.kv_cache.hashing import make_block_hasher
from pagellm.multimodal import MultiModalItem, MultiModalSpec
from pagellm.outputs import RequestOutput
from pagellm.request import Request
from pagellm.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput

ATOL = 1e-4
NUM_NEW = 8
BYTES_PER_BLOCK = 2 * 2 * 16 * 2 * 16 * 4  # layers, k and v, block size, KV heads, head size, fp32
PARAMS = SamplingParams(
    temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=3, prompt_logprobs=3
)

Part = str | torch.Tensor


def pixels(seed: int) -> torch.Tensor:
    return torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(seed))


class Prompts:
    """Prompts of text and images for one LLM (its tokenizer and image spec)."""

    def __init__(self, llm: LLM) -> None:
        self.tokenizer = llm.get_tokenizer()
        [self.spec] = llm.llm_engine.config.model.multimodal_specs

    def make(self, *parts: Part) -> dict:
        ids: list[int] = []
        items = []
        for part in parts:
            if isinstance(part, str):
                ids += self.tokenizer.encode(part)
                continue
            n = self.spec.tokens_per_item
            items.append(MultiModalItem.from_tensor("image", part, len(ids), n))
            ids += [self.spec.placeholder_token_id] * n
        return {"prompt_token_ids": ids, "multi_modal_items": items}


@pytest.fixture(scope="module")
def hf_llava(tiny_llava: str):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(tiny_llava, dtype=torch.float32).eval()


def llava_llm(path: str, **kwargs) -> LLM:
    options = dict(dtype="float32", max_model_len=128, kv_cache_memory=64 * BYTES_PER_BLOCK)
    return LLM(path, **{**options, **kwargs})


@pytest.fixture(scope="module")
def llm(tiny_llava: str) -> LLM:
    return llava_llm(tiny_llava)


def check_against_hf(hf, prompt: dict, output: RequestOutput) -> None:
    completion = output.outputs[0]
    ids = prompt["prompt_token_ids"] + list(completion.token_ids)
    images = [item.tensor() for item in prompt["multi_modal_items"]]
    with torch.no_grad():
        logits = hf(
            input_ids=torch.tensor([ids]),
            pixel_values=torch.stack(images) if images else None,
        ).logits[0]
    ref = logits.float().log_softmax(dim=-1)
    num_prompt = len(prompt["prompt_token_ids"])
    assert ref[num_prompt - 1 : -1].argmax(dim=-1).tolist() == list(completion.token_ids)
    prompt_positions = output.prompt_logprobs[1:] if output.prompt_logprobs else []
    positions = [*prompt_positions, *completion.logprobs]
    positions = [{}] * (len(ids) - 1 - len(positions)) + positions  # prompt's not asked for
    assert len(positions) == len(ids) - 1
    for p, position in enumerate(positions):
        for token, lp in position.items():
            assert abs(lp.logprob - ref[p, token].item()) < ATOL, (p, token)


def generate(llm: LLM, prompts: list[dict]) -> list[RequestOutput]:
    return llm.generate(prompts, PARAMS, use_tqdm=False)


def encoder_cache(llm: LLM) -> dict[str, int]:
    return llm.llm_engine.engine_core.executor.collective_rpc("encoder_cache_stats")[0]


def test_one_and_two_image_prompts_batched_with_text_only_ones_match_hf(llm, hf_llava):
    make = Prompts(llm).make
    prompts = [
        make("Describe", pixels(1), " this image, please."),
        make("What is the same in", pixels(2), " and", pixels(3), "?"),
        make("A text-only prompt in the same batch."),
        make(pixels(4), "starts with its image"),
    ]
    for prompt, output in zip(prompts, generate(llm, prompts), strict=True):
        check_against_hf(hf_llava, prompt, output)


def test_chunked_prefill_cuts_an_image_span_whose_embeddings_are_computed_once(
    tiny_llava, hf_llava
):
    llm = llava_llm(tiny_llava, max_num_batched_tokens=8, enable_prefix_caching=False)
    make = Prompts(llm).make
    # The span is tokens [1, 17): chunks of 8 cut it at 8 and 16, three steps reach it.
    prompt = make("Look", pixels(5), " now.")
    assert prompt["multi_modal_items"][0].offset == 1
    [output] = generate(llm, [prompt])
    check_against_hf(hf_llava, prompt, output)
    assert encoder_cache(llm)["misses"] == 1 and encoder_cache(llm)["hits"] == 2


def test_preempted_image_requests_recompute_and_match_hf(tiny_llava, hf_llava):
    # Room for one request of max_model_len (9 blocks) and a few more blocks: four requests of
    # about 3 blocks each grow past it, so some are preempted and recomputed.
    llm = llava_llm(tiny_llava, max_model_len=128, kv_cache_memory=11 * BYTES_PER_BLOCK)
    make = Prompts(llm).make
    prompts = [make(f"Image number {i} is", pixels(10 + i), " described as") for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    for prompt, output in zip(prompts, outputs, strict=True):
        check_against_hf(hf_llava, prompt, output)


def test_a_repeated_image_is_encoded_once(tiny_llava):
    llm = llava_llm(tiny_llava, enable_prefix_caching=False)
    make = Prompts(llm).make
    generate(llm, [make("First", pixels(20), " look.")])
    assert encoder_cache(llm)["misses"] == 1
    hits = encoder_cache(llm)["hits"]
    generate(llm, [make("Another question about", pixels(20), "?")])
    assert encoder_cache(llm)["misses"] == 1 and encoder_cache(llm)["hits"] == hits + 1
    generate(llm, [make("Another image", pixels(21))])
    assert encoder_cache(llm)["misses"] == 2


def test_a_changed_pixel_changes_the_hashes_of_the_blocks_its_span_overlaps():
    hasher = make_block_hasher(4)
    spec = MultiModalSpec("image", 99, 6, (3, 32, 32))
    image = pixels(30)
    changed = image.clone()
    changed[1, 7, 9] += 0.5

    def block_hashes(tensor: torch.Tensor) -> list[bytes]:
        ids = [5, 6, 7, 8, 9] + [spec.placeholder_token_id] * 6 + [10, 11, 12, 13, 14]
        item = MultiModalItem.from_tensor("image", tensor, 5, 6)
        request = Request("r", ids, SamplingParams(), None, mm_items=[item], block_hasher=hasher)
        return request.block_hashes

    same, other = block_hashes(image), block_hashes(changed)
    assert len(same) == 4 and same == block_hashes(image.clone())
    # Block 0 is before the span [5, 11); blocks 1 and 2 overlap it; block 3 chains after them.
    assert same[0] == other[0]
    assert all(a != b for a, b in zip(same[1:], other[1:], strict=True))


def test_the_prefix_cache_reuses_an_image_s_blocks_only_for_the_same_image(tiny_llava):
    llm = llava_llm(tiny_llava)
    make = Prompts(llm).make
    image = pixels(40)
    changed = image.clone()
    changed[0, 0, 0] += 1.0
    text = "An image comes after this long enough text prefix of tokens:"
    first = make(text, image, " and what follows it.")
    params = SamplingParams(temperature=0.0, max_tokens=2)  # no prompt logprobs: cache hits
    llm.generate(first, params, use_tqdm=False)
    [again] = llm.generate(first, params, use_tqdm=False)
    [other] = llm.generate(make(text, changed, " and what follows it."), params, use_tqdm=False)
    offset = first["multi_modal_items"][0].offset
    block = llm.llm_engine.config.cache.block_size
    assert again.num_cached_tokens > offset + 16  # past the image span
    assert other.num_cached_tokens == offset // block * block  # up to the span's first block


def test_bad_items_are_refused_before_they_reach_the_engine(llm, smollm2_llm):
    make = Prompts(llm).make
    prompt = make("Look", pixels(50))
    item = prompt["multi_modal_items"][0]
    spec_id = Prompts(llm).spec.placeholder_token_id
    with pytest.raises(ValueError, match="placeholder token.* that no item fills"):
        llm.generate({"prompt_token_ids": prompt["prompt_token_ids"]}, PARAMS, use_tqdm=False)
    wrong_shape = MultiModalItem.from_tensor("image", torch.zeros(3, 16, 16), item.offset, 16)
    with pytest.raises(ValueError, match=r"has shape \(3, 16, 16\)"):
        llm.generate({**prompt, "multi_modal_items": [wrong_shape]}, PARAMS, use_tqdm=False)
    shifted = MultiModalItem.from_tensor("image", pixels(50), item.offset - 1, 16)
    with pytest.raises(ValueError, match="is not made of the image placeholder token"):
        llm.generate({**prompt, "multi_modal_items": [shifted]}, PARAMS, use_tqdm=False)
    with pytest.raises(ValueError, match="takes no multimodal input"):
        smollm2_llm.generate(
            {"prompt_token_ids": [5] * 16, "multi_modal_items": [item]}, PARAMS, use_tqdm=False
        )
    with pytest.raises(ValueError, match="multi_modal_data needs the IO processor"):
        smollm2_llm.generate({"prompt": "an image:", "multi_modal_data": {"image": None}})
    assert spec_id in prompt["prompt_token_ids"]
    [ok] = generate(llm, [prompt])  # the engine is as it was
    assert len(ok.outputs[0].token_ids) == NUM_NEW


def test_items_cross_the_engine_core_process_boundary(tiny_llava, llm):
    make = Prompts(llm).make
    prompts = [make("One process away:", pixels(60), "."), make("text")]
    expected = [o.outputs[0].token_ids for o in generate(llm, prompts)]
    remote = llava_llm(tiny_llava, multiprocess_engine=True)
    try:
        got = [o.outputs[0].token_ids for o in generate(remote, prompts)]
    finally:
        remote.llm_engine.shutdown()
    assert got == expected


def test_items_cross_the_executor_wire_as_bytes_shape_and_dtype():
    """What a worker process decodes of a step with a new image request (`executor/wire.py`)."""
    image = pixels(61).to(torch.bfloat16)
    item = MultiModalItem.from_tensor("image", image, 3, 16)
    new = NewRequestData("r", [1, 2, 3] + [9] * 16, SamplingParams(), [1, 2], 0, mm_items=[item])
    out = SchedulerOutput([new], CachedRequestData(), {"r": 19}, 19, set(), set())
    frame = wire.encoder.encode(wire.ExecuteModel(7, out))
    decoded = wire.driver_decoder.decode(frame)
    [got] = decoded.scheduler_output.scheduled_new_reqs[0].mm_items
    assert got == item and got.dtype == "bfloat16" and got.shape == [3, 32, 32]
    assert torch.equal(got.tensor(), image)
