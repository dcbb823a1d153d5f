"""The plugin docs/plugins.md teaches, as a package built from the doc's own code blocks
(tests/plugins/doc_example: a platform and a paged attention backend in plain torch).

Every file of the package is a code block of the doc, verbatim; installed (`pip install -e`), with
its platform active, it generates token for token what the built-in CPU platform and its
TORCH_SDPA backend generate. Plugins load once per process, so each platform runs in a fresh
Python process.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from editable_installs import editable_installs

PACKAGE = Path(__file__).parent / "doc_example"
DOC = Path(__file__).parents[2] / "docs" / "plugins.md"
PACKAGE_FILES = [
    "pyproject.toml",
    *sorted(str(p.relative_to(PACKAGE)) for p in (PACKAGE / "pagellm_doc_example").glob("*.py")),
]


def doc_blocks() -> dict[str, list[str]]:
    """The fenced code blocks of the doc whose first line is a comment naming a file
    (``# pagellm_doc_example/attention.py``), by that name."""
    blocks: dict[str, list[str]] = {}
    for match in re.finditer(r"^```[a-z]*\n(.*?)^```$", DOC.read_text(), re.M | re.S):
        named = re.match(r"# (\S+)\n", match.group(1))
        if named:
            blocks.setdefault(named.group(1), []).append(match.group(1))
    return blocks


@pytest.mark.parametrize("name", PACKAGE_FILES)
def test_each_file_of_the_doc_example_package_is_its_code_block_in_the_doc(name):
    blocks = doc_blocks().get(name, [])
    assert len(blocks) == 1, f"docs/plugins.md has {len(blocks)} code blocks starting '# {name}'"
    text = (PACKAGE / name).read_text()
    diff = difflib.unified_diff(
        blocks[0].splitlines(), text.splitlines(), "docs/plugins.md", name, lineterm=""
    )
    assert blocks[0] == text, "\n".join(diff)


def test_the_doc_shows_no_file_the_doc_example_package_lacks():
    shown = {name for name in doc_blocks() if name.startswith("pagellm_doc_example/")}
    assert shown == {name for name in PACKAGE_FILES if name.startswith("pagellm_doc_example/")}


@pytest.fixture(scope="module")
def installed_doc_example():
    with editable_installs([PACKAGE]):
        yield


# One engine per model. With a budget of 32 tokens a step, the 48- and 70-token prompts are
# prefilled in chunks, next to the decodes of the others; the second call's first prompt shares
# its first 40 tokens (two full blocks of 16) with the first call's, cached by then.
GENERATE = """
import json, sys
from pagellm import LLM, SamplingParams
from pagellm.platforms import current_platform_name

def ids(n, seed):
    return [(seed * 131 + 17 * i) % 900 + 50 for i in range(n)]

greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
shared = ids(40, 1)
results = {}
for name, model in json.loads(sys.argv[1]).items():
    llm = LLM(model, max_model_len=256, kv_cache_memory=64 << 20, max_num_batched_tokens=32)
    first = llm.generate([shared + ids(8, 2)], greedy, use_tqdm=False)
    batch = llm.generate([shared + ids(9, 3), ids(70, 4), ids(3, 5)], greedy, use_tqdm=False)
    cfg = llm.llm_engine.config
    results[name] = dict(
        setup=[current_platform_name(), cfg.attention_backend, cfg.cache.block_size,
               cfg.model.sliding_window],
        tokens=[out.outputs[0].token_ids for out in first + batch],
        cached=[out.num_cached_tokens for out in first + batch],
    )
    del llm
print(json.dumps(results))
"""


def start_generate(models: dict[str, str], env: dict[str, str]) -> subprocess.Popen:
    controls = ("VLLM_PLUGINS", "PAGELLM_PLATFORM", "PAGELLM_PLUGINS_STRICT", "PAGELLM_PLAIN_CPU")
    full_env = {k: v for k, v in os.environ.items() if k not in controls}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(GENERATE), json.dumps(models)],
        env={**full_env, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen) -> dict:
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    return json.loads(stdout)


def test_doc_example_plugin_generates_greedy_identical_to_the_cpu_platform(
    installed_doc_example, tiny_models, smollm2_path
):
    models = {
        "llama3": tiny_models["llama3"],  # GQA: 4 query heads on 2 KV heads
        "mistral": tiny_models["mistral"],  # sliding window of 8 tokens
        "qwen3": tiny_models["qwen3"],  # head_dim 32, not hidden_size / heads
        "smollm2": smollm2_path,
    }
    # Both at once: the two processes are independent.
    reference_proc = start_generate(models, {})
    plugin_proc = start_generate(models, {"PAGELLM_PLAIN_CPU": "1"})
    reference, plugin = finish(reference_proc), finish(plugin_proc)
    for name in models:
        window = 8 if name == "mistral" else None
        assert reference[name]["setup"] == ["cpu", "TORCH_SDPA", 16, window]
        assert plugin[name]["setup"] == ["plain_cpu", "PLAIN_TORCH", 16, window]
        assert plugin[name]["cached"] == reference[name]["cached"] == [0, 32, 0, 0], name
        assert plugin[name]["tokens"] == reference[name]["tokens"], name
