"""Incremental detokenization against whole-text decoding, with SmolLM2's real tokenizer."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pagellm.engine.detokenizer import FastIncrementalDetokenizer, IncrementalDetokenizer
from pagellm.sampling_params import SamplingParams

HELLO, E_ACUTE_FIRST, E_ACUTE_SECOND = 19556, 142, 119  # "Hello", then "é" in two byte tokens


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer_dir):
    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


@pytest.mark.parametrize("cls", [FastIncrementalDetokenizer, IncrementalDetokenizer])
def test_prompt_ending_inside_a_character_gives_the_character_not_the_prompt_again(tokenizer, cls):
    prompt = [HELLO, E_ACUTE_FIRST]
    output = [E_ACUTE_SECOND, *tokenizer.encode(" world", add_special_tokens=False)]
    detok = cls(tokenizer, prompt, SamplingParams())
    text = "".join(detok.update([t]) for t in output)
    assert text == "é world"
    assert tokenizer.decode(prompt + output) == "Hello" + text


@pytest.mark.parametrize("cls", [FastIncrementalDetokenizer, IncrementalDetokenizer])
def test_streamed_text_equals_the_decoded_output(tokenizer, cls):
    prompt = tokenizer.encode("Say it in French:", add_special_tokens=False)
    output = tokenizer.encode(" Bonjour, ça va? 日本語 🙂 fin", add_special_tokens=False)
    detok = cls(tokenizer, prompt, SamplingParams())
    text = "".join(detok.update([t]) for t in output)
    assert text == tokenizer.decode(prompt + output)[len(tokenizer.decode(prompt)) :]


def test_a_streamed_n2_choice_ends_once_while_its_sibling_goes_on(tokenizer):
    """Used to repeat a finished choice (with its finish reason) in every later delta."""
    from pagellm.engine.output_processor import OutputProcessor
    from pagellm.engine.processor import ProcessedPrompt, fan_out
    from pagellm.request import FinishReason
    from pagellm.sampling_params import RequestOutputKind
    from pagellm.scheduler.output import EngineCoreOutput, EngineCoreOutputs

    processor = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, max_tokens=4, output_kind=RequestOutputKind.DELTA)
    processor.add_request("r", ProcessedPrompt(None, [HELLO], params), fan_out("r", params))
    length = int(FinishReason.LENGTH)
    steps = [
        [EngineCoreOutput("0_r", [11]), EngineCoreOutput("1_r", [12])],
        [EngineCoreOutput("0_r", [13], finish_reason=length), EngineCoreOutput("1_r", [14])],
        [EngineCoreOutput("1_r", [15])],
        [EngineCoreOutput("1_r", [16], finish_reason=length)],
    ]
    finishes: dict[int, int] = {}
    for step in steps:
        outputs, _ = processor.process_outputs(EngineCoreOutputs(outputs=step))
        for output in outputs:
            for completion in output.outputs:
                if completion.finish_reason is not None:
                    finishes[completion.index] = finishes.get(completion.index, 0) + 1
    assert finishes == {0: 1, 1: 1}
    assert not processor.requests


@pytest.fixture(scope="module")
def wordpiece_decoded(smollm2_tokenizer_dir, tmp_path_factory):
    """SmolLM2's tokenizer with a WordPiece decoder, which puts a space between tokens (special
    ones included), as BERT-style tokenizers do."""
    import json
    import shutil
    from pathlib import Path

    directory = tmp_path_factory.mktemp("wordpiece_decoded")
    for path in Path(smollm2_tokenizer_dir).glob("tokenizer*"):
        shutil.copy(path, directory)
    spec = json.loads((directory / "tokenizer.json").read_text())
    spec["decoder"] = {"type": "WordPiece", "prefix": "##", "cleanup": False}
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    return AutoTokenizer.from_pretrained(directory)


def test_without_spaces_between_special_tokens_adjacent_ones_are_joined(wordpiece_decoded):
    from pagellm.engine.detokenizer import make_detokenizer

    start, end = wordpiece_decoded.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    output = [start, end, HELLO, start, end, end]
    prompt = wordpiece_decoded.encode("Hi", add_special_tokens=False)

    def text(**params: bool) -> str:
        detok = make_detokenizer(wordpiece_decoded, prompt, SamplingParams(**params))
        return "".join(detok.update([t]) for t in output)

    spaced = " <|im_start|> <|im_end|> Hello <|im_start|> <|im_end|> <|im_end|>"
    assert text(skip_special_tokens=False) == spaced
    joined = " <|im_start|><|im_end|> Hello <|im_start|><|im_end|><|im_end|>"
    assert text(skip_special_tokens=False, spaces_between_special_tokens=False) == joined
    assert text(spaces_between_special_tokens=False) == text() == " Hello"


SPACE_AND_CJK_LEAD = 17097  # " " and the first byte of a three-byte character, in one token


def streamed(detok, output: list[int]) -> str:
    return "".join(detok.update([t]) for t in output)


def random_outputs(tokenizer, count: int, length: int) -> list[list[int]]:
    """Token runs mixing text, emoji and CJK (several tokens per character), special tokens and
    bare byte tokens that start characters they never finish."""
    import random

    rng = random.Random(17)
    pieces = [
        tokenizer.encode(text, add_special_tokens=False)
        for text in (" Bonjour", ", ça va?", " 日本語", " 🙂", "\n", " fin", "é", " ok")
    ]
    pieces += [[i] for i in tokenizer.all_special_ids] + [[E_ACUTE_FIRST], [SPACE_AND_CJK_LEAD]]
    runs = []
    for _ in range(count):
        run: list[int] = []
        while len(run) < length:
            run += rng.choice(pieces)
        runs.append(run[: rng.randrange(1, length + 1)])
    return runs


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("cls", [FastIncrementalDetokenizer, IncrementalDetokenizer])
def test_decode_all_gives_the_streamed_text(tokenizer, cls, skip_special_tokens):
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    prompts = [
        tokenizer.encode("Say it:", add_special_tokens=False),
        [HELLO, E_ACUTE_FIRST],  # ends inside a character
        [],
    ]
    runs = random_outputs(tokenizer, 60, 24)
    for prompt in prompts:
        for output in runs:
            whole = cls(tokenizer, prompt, params).decode_all(output)
            assert whole == streamed(cls(tokenizer, prompt, params), output), (prompt, output)


@pytest.mark.parametrize(
    ("output", "text"),
    [
        ([HELLO, E_ACUTE_FIRST], "Hello"),  # ends inside a character: held back
        ([HELLO, E_ACUTE_FIRST, SPACE_AND_CJK_LEAD], "Hello"),  # text between broken characters
        ([HELLO, E_ACUTE_FIRST, SPACE_AND_CJK_LEAD, HELLO], "Hello\ufffd \ufffdHello"),
    ],
)
def test_decode_all_holds_back_an_unfinished_character_at_the_end(tokenizer, output, text):
    prompt = tokenizer.encode("Hi", add_special_tokens=False)
    params = SamplingParams()
    assert FastIncrementalDetokenizer(tokenizer, prompt, params).decode_all(output) == text
    assert streamed(FastIncrementalDetokenizer(tokenizer, prompt, params), output) == text


def test_decode_all_with_a_non_byte_level_decoder_goes_token_by_token(wordpiece_decoded):
    """A WordPiece decoder drops the space before a whole output's first word, which the stream
    (primed with the prompt) keeps: one decode of the output would not be the streamed text."""
    from pagellm.engine.detokenizer import make_detokenizer

    prompt = wordpiece_decoded.encode("Hi", add_special_tokens=False)
    output = [HELLO, *wordpiece_decoded.encode(" world", add_special_tokens=False)]
    params = SamplingParams()
    whole = make_detokenizer(wordpiece_decoded, prompt, params).decode_all(output)
    assert whole == streamed(make_detokenizer(wordpiece_decoded, prompt, params), output)
    assert whole != wordpiece_decoded.backend_tokenizer.decode(output)
