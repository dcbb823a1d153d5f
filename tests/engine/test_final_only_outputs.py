"""``FINAL_ONLY`` outputs, whose text and logprobs are made once at the end, equal the last
``CUMULATIVE`` output, made token by token: the output processor on its own with SmolLM2's real
tokenizer, and whole engines on a tiny Llama."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from pagellm import SamplingParams
from pagellm.engine.output_processor import OutputProcessor
from pagellm.engine.processor import ProcessedPrompt, fan_out
from pagellm.outputs import RequestOutput
from pagellm.request import FinishReason
from pagellm.sampling_params import RequestOutputKind
from pagellm.scheduler.output import EngineCoreOutput, EngineCoreOutputs, SampleLogprobs

FINAL, CUMULATIVE = RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE
HELLO, E_ACUTE_FIRST = 19556, 142  # "Hello"; the first byte of "é"
LENGTH, STOP = int(FinishReason.LENGTH), int(FinishReason.STOP)


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer_dir):
    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


def engine_steps(tokenizer, num_completions: int, length: int, logprobs: bool, seed: int):
    """Per step, the engine-core outputs of each completion: text with multi-token characters,
    special tokens, logprobs with top-k entries; the first completion ends on a stop token, the
    others on their length."""
    rng = random.Random(seed)
    text = tokenizer.encode(" Bonjour, ça va? 日本語 🙂 <|im_end|> fin é", add_special_tokens=False)
    tokens = [[rng.choice(text) for _ in range(length)] for _ in range(num_completions)]
    steps = []
    for step in range(length):
        outputs = []
        for index in range(num_completions):
            sample = None
            if logprobs:
                top = [rng.randrange(300, 2000) for _ in range(3)]
                values = sorted((rng.uniform(-9.0, -0.01) for _ in range(4)), reverse=True)
                sample = SampleLogprobs([tokens[index][step], *top], values, rng.randrange(0, 4))
            last = step == length - 1
            outputs.append(
                EngineCoreOutput(
                    f"{index}_r" if num_completions > 1 else "r",
                    [tokens[index][step]],
                    [sample] if sample is not None else None,
                    (STOP if index == 0 else LENGTH) if last else None,
                    tokens[index][step] if last and index == 0 else None,
                )
            )
        steps.append(outputs)
    return steps


def run(tokenizer, params: SamplingParams, prompt: list[int], steps) -> list[RequestOutput]:
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", ProcessedPrompt(None, prompt, params), fan_out("r", params))
    results = []
    for outputs in steps:
        if "r" not in processor.requests:
            break
        results += processor.process_outputs(EngineCoreOutputs(outputs=outputs))[0]
    assert not processor.requests
    return results


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("logprobs", [False, True])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("prompt", [[HELLO], [HELLO, E_ACUTE_FIRST]])  # the last: half a "é"
def test_final_output_equals_the_last_cumulative_output(
    tokenizer, n, logprobs, skip_special_tokens, prompt
):
    for seed in range(8):
        steps = engine_steps(tokenizer, n, 6 + 3 * seed, logprobs, seed)
        kwargs = dict(
            n=n, logprobs=3 if logprobs else None, skip_special_tokens=skip_special_tokens
        )
        final = run(tokenizer, SamplingParams(**kwargs, output_kind=FINAL), prompt, steps)
        cumulative = run(tokenizer, SamplingParams(**kwargs, output_kind=CUMULATIVE), prompt, steps)
        assert len(final) == 1 and final[0].finished
        assert final[0] == cumulative[-1]
        first = final[0].outputs[0]
        assert (first.finish_reason, first.stop_reason) == ("stop", steps[-1][0].new_token_ids[0])
        assert (first.logprobs is not None) == logprobs


def test_final_output_waits_for_its_text_until_the_end(tokenizer):
    """The fast path really runs: no text is decoded while the request goes on."""
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(output_kind=FINAL, logprobs=1)
    processor.add_request("r", ProcessedPrompt(None, [HELLO], params), fan_out("r", params))
    sample = SampleLogprobs([HELLO, 300], [-0.5, -1.5], 0)
    outputs, _ = processor.process_outputs(
        EngineCoreOutputs(outputs=[EngineCoreOutput("r", [HELLO], [sample])])
    )
    completion = processor.requests["r"].completions[0]
    assert outputs == [] and completion.token_ids == [HELLO]
    assert completion.text == "" and completion.logprobs == []
    outputs, _ = processor.process_outputs(
        EngineCoreOutputs(outputs=[EngineCoreOutput("r", [HELLO], [sample], LENGTH)])
    )
    (done,) = outputs[0].outputs
    assert done.text == "HelloHello" and done.cumulative_logprob == -1.0
    assert [list(p) for p in done.logprobs] == [[HELLO, 300], [HELLO, 300]]


def test_stop_string_request_goes_token_by_token_and_ends_at_the_string(tokenizer):
    output = tokenizer.encode(" Bonjour, ça va? fin et plus", add_special_tokens=False)
    steps = [[EngineCoreOutput("r", [t])] for t in output]
    results = {}
    for kind in (FINAL, CUMULATIVE):
        params = SamplingParams(stop=["va?"], output_kind=kind)
        results[kind] = run(tokenizer, params, [HELLO], steps)
    (final,) = results[FINAL]
    assert final == results[CUMULATIVE][-1]
    assert final.outputs[0].text == " Bonjour, ça "
    assert (final.outputs[0].finish_reason, final.outputs[0].stop_reason) == ("stop", "va?")


def test_aborted_final_request_has_the_text_so_far(tokenizer):
    output = tokenizer.encode(" Bonjour, ça va", add_special_tokens=False)
    aborted = {}
    for kind in (FINAL, CUMULATIVE):
        processor = OutputProcessor(tokenizer)
        params = SamplingParams(output_kind=kind, logprobs=0)
        processor.add_request("r", ProcessedPrompt(None, [HELLO], params), fan_out("r", params))
        for t in output:
            sample = SampleLogprobs([t], [-0.25], 0)
            processor.process_outputs(
                EngineCoreOutputs(outputs=[EngineCoreOutput("r", [t], [sample])])
            )
        (aborted[kind],) = processor.abort_requests(["r"])
    assert aborted[FINAL] == aborted[CUMULATIVE]
    assert aborted[FINAL].outputs[0].text == " Bonjour, ça va"
    assert aborted[FINAL].outputs[0].finish_reason == "abort"


@pytest.fixture(scope="module")
def engine_dir(tiny_models):
    return tiny_models["llama3"]


def generate(model_dir: str, params: list[SamplingParams]) -> list[RequestOutput]:
    """The last output of each request, stepping an engine until every request is done."""
    from pagellm.engine.args import EngineArgs
    from pagellm.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(
        EngineArgs(model=model_dir, max_model_len=128, kv_cache_memory=8 << 20)
    )
    rng = random.Random(3)
    for i, p in enumerate(params):
        prompt = [rng.randrange(3, 1024) for _ in range(5 + 3 * i)]
        engine.add_request(str(i), {"prompt_token_ids": prompt}, p)
    last: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            last[output.request_id] = output
    return [last[str(i)] for i in range(len(params))]


def test_engine_final_outputs_equal_cumulative_ones(engine_dir):
    """Greedy and seeded sampling, n > 1, logprobs, stop token ids, max_tokens, a stop string."""
    cases = [
        dict(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2),
        dict(temperature=1.0, seed=7, n=3, max_tokens=16, logprobs=1),
        dict(temperature=1.0, seed=11, max_tokens=30, stop_token_ids=list(range(3, 400))),
        dict(temperature=0.0, max_tokens=1),
        dict(
            temperature=1.0, seed=5, max_tokens=30, stop=["e", "a"], include_stop_str_in_output=True
        ),
    ]
    final = generate(engine_dir, [SamplingParams(**c, output_kind=FINAL) for c in cases])
    cumulative = generate(engine_dir, [SamplingParams(**c, output_kind=CUMULATIVE) for c in cases])
    assert final == cumulative
    reasons = [(c.finish_reason, c.stop_reason) for o in final for c in o.outputs]
    assert ("stop", None) not in reasons[:1]  # greedy, ignore_eos: ends on its length
    assert any(r[0] == "stop" and isinstance(r[1], int) for r in reasons)
    assert final[-1].outputs[0].finish_reason == "stop"
    assert final[-1].outputs[0].stop_reason in ("e", "a")
    assert len(final[1].outputs) == 3 and final[1].outputs[0].logprobs


DELTA = RequestOutputKind.DELTA


def test_plain_delta_stream_gives_the_outputs_of_the_general_path(tokenizer):
    """A DELTA request without stop strings or logprobs takes the short path per token
    (``plain_delta``); the general path (here: with a stop string that never matches) gives the
    same outputs, texts held back inside a character included."""
    for prompt in ([HELLO], [HELLO, E_ACUTE_FIRST]):
        for seed in range(4):
            steps = engine_steps(tokenizer, 1, 8 + seed, False, seed)
            plain = run(tokenizer, SamplingParams(output_kind=DELTA), prompt, steps)
            general = run(
                tokenizer, SamplingParams(output_kind=DELTA, stop=["\x07"]), prompt, steps
            )
            assert plain == general
            assert "".join(o.outputs[0].text for o in plain)


def test_plain_delta_path_is_taken_and_skipped_when_logprobs_are_asked(tokenizer):
    for params, plain in (
        (SamplingParams(output_kind=DELTA), True),
        (SamplingParams(output_kind=DELTA, logprobs=1), False),
        (SamplingParams(output_kind=DELTA, n=2), False),
        (SamplingParams(output_kind=CUMULATIVE), False),
    ):
        processor = OutputProcessor(tokenizer)
        processor.add_request("r", ProcessedPrompt(None, [HELLO], params), fan_out("r", params))
        assert [c.plain_delta for c in processor.requests["r"].completions][0] == plain


def run_interval(tokenizer, params: SamplingParams, steps, interval: int) -> list[RequestOutput]:
    processor = OutputProcessor(tokenizer, stream_interval=interval)
    processor.add_request("r", ProcessedPrompt(None, [HELLO], params), fan_out("r", params))
    results = []
    for outputs in steps:
        results += processor.process_outputs(EngineCoreOutputs(outputs=outputs))[0]
    return results


@pytest.mark.parametrize("kwargs", [{}, {"stop": ["\x07"]}, {"n": 2}])  # plain path, general
def test_stream_interval_sends_its_first_token_then_chunks_of_that_many(tokenizer, kwargs):
    n = kwargs.get("n", 1)
    steps = engine_steps(tokenizer, n, 11, False, 1)
    params = SamplingParams(output_kind=DELTA, **kwargs)
    every_step = run_interval(tokenizer, params, steps, 1)
    chunked = run_interval(tokenizer, params, steps, 4)
    assert len(every_step) == 11
    assert [len(o.outputs[0].token_ids) for o in chunked] == [1, 4, 4, 2]
    for index in range(n):

        def joined(outputs, index=index):
            parts = [c for o in outputs for c in o.outputs if c.index == index]
            return "".join(c.text for c in parts), [t for c in parts for t in c.token_ids]

        assert joined(chunked) == joined(every_step)
    assert chunked[-1].finished and chunked[-1].outputs[0].finish_reason == "stop"
