"""The plugin system against really installed plugin packages (tests/plugins/*, `pip install -e`).

Plugin loading is once per process, so each scenario runs in a fresh Python process with its own
environment (VLLM_PLUGINS, PAGELLM_PLUGINS_STRICT, the dummy platform's switches). Each test names
its processes (`scenarios`); the module starts them all ahead, two at a time in the tests' order
(`pool`): each mostly imports, on one core, so both cores of a 2-core machine stay busy while the
tests read the results.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from editable_installs import editable_installs

# broken_attention is the conformance kit's (test_conformance_kit.py): a backend that breaks its
# own declarations has no business in these scenarios.
PLUGIN_DIRS = sorted(
    p
    for p in Path(__file__).parent.iterdir()
    if (p / "pyproject.toml").exists() and p.name != "broken_attention"
)
CONTROL_VARS = (
    "VLLM_PLUGINS",
    "PAGELLM_PLUGINS_STRICT",
    "PAGELLM_PLATFORM",
    "PAGELLM_DUMMY_PLATFORM",
    "PAGELLM_DUMMY_PLATFORM_B",
    "PAGELLM_BROKEN_PLATFORMS",
)


@pytest.fixture(scope="module", autouse=True)
def installed_plugins():
    with editable_installs(PLUGIN_DIRS):
        yield


def run(code: str, env: dict[str, str] | None, *args: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in CONTROL_VARS}
    full_env.update(env or {})
    argv = [sys.executable, "-c", textwrap.dedent(code), *args]
    return subprocess.run(argv, env=full_env, capture_output=True, text=True, timeout=300)


@dataclasses.dataclass(frozen=True)
class Model:
    """A scenario's argument: the path of the tiny model of that kind (or of ``dummy_arch``)."""

    kind: str


def scenarios(**calls: tuple) -> pytest.MarkDecorator:
    """The processes a test reads, by name: (code, env, *args), `Model` arguments standing for
    model paths. A name several tests give is one process (the same call)."""
    return pytest.mark.scenarios(**calls)


def make_dummy_arch_model(tiny_models: dict[str, str], target: Path) -> str:
    shutil.copytree(tiny_models["llama3"], target)
    config = json.loads((target / "config.json").read_text())
    config["architectures"] = ["DummyLlamaForCausalLM"]
    (target / "config.json").write_text(json.dumps(config))
    return str(target)


@pytest.fixture(scope="module")
def pool(
    request: pytest.FixtureRequest, tiny_models: dict[str, str], tmp_path_factory
) -> Iterator[dict[str, Future]]:
    """The scenarios of the module's selected tests, started ahead in the tests' order, two at a
    time; ``pool[name].result()`` waits for one."""
    arch = make_dummy_arch_model(tiny_models, tmp_path_factory.mktemp("dummy_arch") / "model")
    models = {**tiny_models, "dummy_arch": arch}
    calls: dict[str, tuple] = {}
    for item in request.session.items:
        for mark in item.iter_markers("scenarios") if item.module is request.module else ():
            for name, call in mark.kwargs.items():
                assert calls.setdefault(name, call) == call, f"two scenarios named {name!r}"
    executor = ThreadPoolExecutor(max_workers=2)
    try:
        yield {
            name: executor.submit(
                run, code, env, *(models[a.kind] if isinstance(a, Model) else a for a in args)
            )
            for name, (code, env, *args) in calls.items()
        }
    finally:
        executor.shutdown(cancel_futures=True)


PLUGINS_CLI = (
    "import sys\nfrom pagellm.entrypoints.cli import main; raise SystemExit(main(sys.argv[1:]))"
)


def plugins_json_call(env: dict[str, str] | None = None) -> tuple:
    """A scenario: ``pagellm plugins --json``."""
    return (PLUGINS_CLI, env, "plugins", "--json")


def plugins_json(pool: dict[str, Future], name: str) -> dict:
    proc = pool[name].result()
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    return {group: {r["name"]: r for r in records} for group, records in report.items()}


GENERATE = """
import sys
from pagellm import LLM, SamplingParams
llm = LLM(sys.argv[1], max_model_len=64, kv_cache_memory=4 << 20, **eval(sys.argv[2] if len(sys.argv) > 2 else "{}"))
out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
cfg = llm.llm_engine.config
from pagellm.platforms import current_platform
print(current_platform.name, cfg.attention_backend, cfg.cache.block_size, out[0].outputs[0].token_ids)
"""
# GENERATE, then the front-end registries' plugins: with no allowlist, one process for the tests
# that read it (broken plugins logged, the reference of the dummy platform, the front-end groups).
GENERATE_FRONT_END = GENERATE + textwrap.dedent("""
    from pagellm.io_processors import io_processors
    from pagellm.metrics.registry import stat_loggers
    print(io_processors.get("upper_text")(cfg, None).pre_process(["hi"])[0], stat_loggers.get("collecting").__name__)
""")
PLAIN_GENERATE = (GENERATE_FRONT_END, None, Model("llama3"))


@scenarios(default_report=plugins_json_call())
def test_plugins_json_reports_each_plugin_with_distribution_status_and_reason(pool):
    report = plugins_json(pool, "default_report")
    assert list(report)[:9] == [
        "pagellm.general_plugins",
        "pagellm.platform_plugins",
        "pagellm.attention_backends",
        "pagellm.quantization_methods",
        "pagellm.scheduler_policies",
        "pagellm.io_processor_plugins",
        "pagellm.stat_logger_plugins",
        "pagellm.endpoint_plugins",
        "pagellm.model_formats",
    ]
    general = report["pagellm.general_plugins"]
    model = general["dummy_model"]
    assert (model["distribution"], model["version"], model["api_version"], model["status"]) == (
        "pagellm-dummy-model",
        "0.1.0",
        "1.0",
        "loaded",
    )
    assert general["broken_import"]["status"] == "failed"
    assert "pagellm_missing_dependency" in general["broken_import"]["reason"]
    misspelled = general["misspelled_hook"]
    assert misspelled["status"] == "failed"
    assert (
        "pagellm_regsiter" in misspelled["reason"] and "pagellm_register()" in misspelled["reason"]
    )
    wrong = general["wrong_args"]["reason"]
    assert "registry" in wrong and "pagellm_register()" in wrong
    future = general["future_api"]["reason"]
    assert "2.0" in future and "1.3" in future
    assert report["pagellm.platform_plugins"]["dummy"]["reason"].startswith("inactive")
    assert report["pagellm.attention_backends"]["dummy_attn"]["status"] == "loaded"
    assert report["pagellm.quantization_methods"]["dummy_int8"]["status"] == "loaded"
    assert report["pagellm.io_processor_plugins"]["dummy_io"]["status"] == "loaded"
    assert report["pagellm.stat_logger_plugins"]["dummy_stats"]["status"] == "loaded"
    policies = report["pagellm.scheduler_policies"]
    assert policies["builtin_policies"]["distribution"] == "pagellm"
    assert [policies[n]["status"] for n in ("builtin_policies", "shortest_prompt")] == [
        "loaded"
    ] * 2
    assert policies["shortest_prompt"]["api_version"] == "1.1"
    for record in report["pagellm.endpoint_plugins"].values():
        assert record["status"] == "skipped" and "off unless named" in record["reason"]


# The longest scenario (four engines, two in their own process): early in the pool.
POLICY_ORDER = """
import sys
from pagellm import LLM, SamplingParams
for policy in ("fcfs", "shortest_prompt_first"):
    for multiprocess in (False, True):
        llm = LLM(sys.argv[1], max_model_len=128, kv_cache_memory=8 << 20, max_num_seqs=1,
                  scheduling_policy=policy, multiprocess_engine=multiprocess)
        engine = llm.llm_engine
        # "first" is alone when the engine core first schedules; while its 48 steps run, the
        # others wait for the policy to choose.
        engine.add_request("first", [100], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        engine.add_request("long", list(range(10, 50)), params)
        engine.add_request("short", list(range(10, 20)), params)
        finished = []
        while engine.has_unfinished_requests():
            finished += [o.request_id for o in engine.step() if o.finished]
        print(policy, multiprocess, *finished)
        del llm, engine
try:
    LLM(sys.argv[1], max_model_len=128, kv_cache_memory=8 << 20, scheduling_policy="nope")
except ValueError as exc:
    print(exc)
"""


@scenarios(policy_order=(POLICY_ORDER, None, Model("llama3")))
def test_scheduling_policy_from_a_plugin_orders_admission_in_process_and_in_the_engine_core(pool):
    proc = pool["policy_order"].result()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "fcfs False first long short",
        "fcfs True first long short",
        "shortest_prompt_first False first short long",
        "shortest_prompt_first True first short long",
        "Scheduling policy 'nope' is not installed; installed: fcfs, priority, "
        "shortest_prompt_first.",
    ]


@scenarios(plugins_table=(PLUGINS_CLI, {"PAGELLM_DUMMY_PLATFORM": "1"}, "plugins"))
def test_plugins_command_prints_a_table_per_group_and_plugins_log_at_info(pool):
    proc = pool["plugins_table"].result()
    assert proc.returncode == 0
    assert "pagellm.general_plugins" in proc.stdout
    assert "broken_import" in proc.stdout and "failed" in proc.stdout
    assert "Traceback" in proc.stderr  # the failure is logged with its traceback
    # The plugin's own logger shows at the level the CLI gives pagellm's loggers.
    assert "INFO pagellm_dummy_platform.plugin: dummy hardware found" in proc.stderr


@scenarios(default_report=plugins_json_call())
def test_vllm_style_entry_points_and_groups_are_answered_with_the_fix(pool):
    report = plugins_json(pool, "default_report")
    function_value = report["pagellm.general_plugins"]["function_value"]
    assert function_value["status"] == "failed"
    assert "names an attribute (the vLLM style" in function_value["reason"]
    assert "set the value to 'pagellm_broken_plugin.vllm_style'" in function_value["reason"]
    assert "`@hookimpl def pagellm_register()`" in function_value["reason"]
    vllm_group = report["vllm.general_plugins"]["vllm_group"]
    assert (vllm_group["status"], vllm_group["reason"]) == (
        "ignored",
        "unknown group 'vllm.general_plugins': move it to 'pagellm.general_plugins'",
    )
    misspelled = report["pagellm.platform_plugin"]["misspelled_group"]
    assert (misspelled["status"], misspelled["distribution"]) == (
        "ignored",
        "pagellm-broken-plugin",
    )
    assert misspelled["reason"].endswith("move it to 'pagellm.platform_plugins'")
    # Other projects' groups are theirs, however alike: otherproject.attention_backends, console_scripts.
    assert all(group.startswith(("pagellm.", "vllm.")) for group in report), sorted(report)


@scenarios(
    default_report=plugins_json_call(),
    broken_platforms_report=plugins_json_call({"PAGELLM_BROKEN_PLATFORMS": "1"}),
)
def test_misregistered_classes_are_reported_by_plugin_name(pool):
    attention = plugins_json(pool, "default_report")["pagellm.attention_backends"]
    misnamed = attention["misnamed_backend"]
    assert misnamed["status"] == "misregistered"
    assert "'SDPA_ALIAS'" in misnamed["reason"] and "its name is 'TORCH_SDPA'" in misnamed["reason"]
    assert attention["dummy_attn"]["status"] == "loaded"
    platforms = plugins_json(pool, "broken_platforms_report")["pagellm.platform_plugins"]
    bad_path = platforms["bad_path"]
    assert bad_path["status"] == "misregistered"
    assert "pagellm_broken_plugin.no_such_module.Platform" in bad_path["reason"]
    assert "does not import: ModuleNotFoundError" in bad_path["reason"]
    assert platforms["bad_signature"]["status"] == "misregistered"
    assert "does not fit Platform" in platforms["bad_signature"]["reason"]
    assert platforms["dummy"]["reason"].startswith("inactive")


BAD_SIGNATURE = {"PAGELLM_BROKEN_PLATFORMS": "1", "PAGELLM_PLATFORM": "bad_signature"}


@scenarios(bad_signature=(GENERATE, BAD_SIGNATURE, Model("llama3")))
def test_platform_with_a_wrong_signature_is_refused_when_chosen_naming_the_plugin(pool):
    proc = pool["bad_signature"].result()
    assert proc.returncode != 0
    assert "PluginError: Platform 'bad_signature'" in proc.stderr
    assert "from plugin 'bad_signature' of pagellm-broken-plugin" in proc.stderr
    assert (
        "available_kv_cache_memory(config, model_bytes) cannot be called as "
        "Platform.available_kv_cache_memory(config, model_bytes, profile_run)" in proc.stderr
    )
    assert "synchronize is a method, Platform.synchronize is a class method" in proc.stderr
    assert "TypeError" not in proc.stderr


@scenarios(plain_generate=PLAIN_GENERATE)
def test_broken_plugins_are_logged_and_llm_still_generates(pool):
    proc = pool["plain_generate"].result()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0:3] == ["cpu", "TORCH_SDPA", "16"]
    assert "broken_import" in proc.stderr and "pagellm_missing_dependency" in proc.stderr


BROKEN_GENERAL = ("broken_import", "misspelled_hook", "wrong_args", "future_api", "function_value")


STRICT = {"PAGELLM_PLUGINS_STRICT": "1"}


@scenarios(
    strict_generate=(GENERATE, STRICT, Model("llama3")), strict_cli=(PLUGINS_CLI, STRICT, "plugins")
)
def test_strict_mode_fails_start_up_naming_every_failed_plugin(pool):
    proc, cli = pool["strict_generate"].result(), pool["strict_cli"].result()
    assert proc.returncode != 0
    error = proc.stderr.splitlines()[-1]
    assert error.startswith("pagellm.plugins.loader.PluginError: 5 plugin(s) of group")
    assert all(f"'{name}'" in error for name in BROKEN_GENERAL)
    assert "PAGELLM_PLUGINS_STRICT=1" in error
    assert cli.returncode == 2
    error = cli.stderr[cli.stderr.index("pagellm: error:") :]
    assert all(f"'{name}'" in error for name in (*BROKEN_GENERAL, "misnamed_backend"))


@scenarios(
    empty_allowlist_report=plugins_json_call({"VLLM_PLUGINS": ""}),
    empty_allowlist_generate=(
        GENERATE,
        {"VLLM_PLUGINS": "", "PAGELLM_DUMMY_PLATFORM": "1"},
        Model("llama3"),
    ),
)
def test_empty_allowlist_loads_nothing_and_runs_on_builtin_cpu_and_reference_backend(pool):
    report = plugins_json(pool, "empty_allowlist_report")
    proc = pool["empty_allowlist_generate"].result()
    records = [r for group in report.values() for r in group.values() if not _own_or_ignored(r)]
    assert records and all(r["status"] == "skipped" for r in records)
    assert all(r["reason"] == "not in the VLLM_PLUGINS allowlist" for r in records)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0:2] == ["cpu", "TORCH_SDPA"]
    assert "WARNING" not in proc.stderr and "ERROR" not in proc.stderr


def _own_or_ignored(record: dict) -> bool:
    """pagellm's own plugins load whatever the allowlist says; ignored ones never load."""
    return record["distribution"] == "pagellm" or record["status"] == "ignored"


ALLOWLIST = {"VLLM_PLUGINS": "dummy_model,dummy_attn,dummy_endpoint,no_such_plugin"}


@scenarios(allowlist_report=plugins_json_call(ALLOWLIST))
def test_allowlist_loads_only_the_named_plugins_and_tells_not_installed_names_apart(pool):
    report = plugins_json(pool, "allowlist_report")
    assert report.pop("VLLM_PLUGINS") == {
        "no_such_plugin": {
            "name": "no_such_plugin",
            "distribution": None,
            "version": None,
            "api_version": None,
            "status": "not installed",
            "reason": "VLLM_PLUGINS names it, but no installed package declares a plugin of that name",
        }
    }
    assert report["pagellm.general_plugins"]["broken_import"]["reason"] == (
        "not in the VLLM_PLUGINS allowlist"
    )
    assert report["pagellm.scheduler_policies"]["builtin_policies"]["status"] == "loaded"
    statuses = {
        name: r["status"]
        for group in report.values()
        for name, r in group.items()
        if not _own_or_ignored(r)
    }
    assert (
        statuses.pop("dummy_model")
        == statuses.pop("dummy_attn")
        == statuses.pop("dummy_endpoint")
        == "loaded"
    )
    assert set(statuses.values()) == {"skipped"}


ENDPOINTS = """
import json, logging, sys
logging.basicConfig(level=logging.INFO)
from pagellm.plugins import load_endpoint_plugins
endpoints = json.loads(sys.argv[1])
enabled = load_endpoint_plugins(endpoints, {"generate"})
# A plugin API 1.0 plugin: the API server attaches it as attach(app, engine_client).
assert all(plugin.api_version == "1.0" for _, plugin in enabled)
print(json.dumps([name for name, _ in enabled]))
"""
ENDPOINT_CASES = [
    (None, None),
    (["not_installed_endpoint"], None),
    (["dummy_endpoint"], None),
    (["dummy_endpoint", "embed_endpoint"], None),
    # VLLM_PLUGINS, when set, is the allowlist whatever the serve command enables.
    (["dummy_endpoint"], {"VLLM_PLUGINS": "dummy_model"}),
    (None, {"VLLM_PLUGINS": "dummy_endpoint"}),
]


@scenarios(
    **{
        f"endpoints_{i}": (ENDPOINTS, env, json.dumps(endpoints))
        for i, (endpoints, env) in enumerate(ENDPOINT_CASES)
    }
)
def test_endpoint_plugins_are_deny_by_default_and_need_matching_tasks(pool):
    procs = [pool[f"endpoints_{i}"].result() for i in range(len(ENDPOINT_CASES))]
    assert all(proc.returncode == 0 for proc in procs), [proc.stderr for proc in procs]
    served = [json.loads(proc.stdout) for proc in procs]
    assert served == [[], [], ["dummy_endpoint"], ["dummy_endpoint"], [], ["dummy_endpoint"]]
    log = procs[3].stderr
    assert "embed_endpoint" in log and "required_tasks ['embed']" in log


@scenarios(
    dummy_arch_generate=(GENERATE, None, Model("dummy_arch")),
    dummy_arch_refused=(GENERATE, {"VLLM_PLUGINS": ""}, Model("dummy_arch")),
)
def test_out_of_tree_model_from_general_plugin_is_usable_by_llm(pool):
    proc, refused = pool["dummy_arch_generate"].result(), pool["dummy_arch_refused"].result()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("[7, 7, 7, 7]")  # the plugin model's favoured token
    assert refused.returncode != 0 and "DummyLlamaForCausalLM" in refused.stderr


ENGINE_CORE_CHILD = """
import json, multiprocessing, sys
from pagellm.engine.args import EngineArgs
from pagellm.plugins import load_general_plugins
sys.path.insert(0, sys.argv[2])
from engine_core_child import run_engine_core

if __name__ == "__main__":
    load_general_plugins()
    args = EngineArgs(sys.argv[1], max_model_len=64, kv_cache_memory=4 << 20, **eval(sys.argv[3]))
    config = args.create_engine_config()
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=run_engine_core, args=(config, queue))
    child.start()
    tokens, platform, groups = queue.get(timeout=240)
    child.join(timeout=60)
    print(json.dumps(dict(exitcode=child.exitcode, backend=config.attention_backend,
                          platform=platform, tokens=tokens, groups=groups)))
"""


def engine_core_child_call(model: Model, env: dict[str, str] | None = None, **kwargs) -> tuple:
    """A scenario: the front end resolves the config; a spawned engine-core process (a fresh
    interpreter that never saw the front end's registrations) builds the engine from it and runs
    one request."""
    return (ENGINE_CORE_CHILD, env, model, str(Path(__file__).parent), repr(kwargs))


def engine_core_child_result(proc: subprocess.CompletedProcess) -> dict:
    """What `engine_core_child_call` reports: the config's backend, the child's platform, its
    tokens and the plugin groups it loaded."""
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["exitcode"] == 0
    return result


@scenarios(dummy_arch_engine_core=engine_core_child_call(Model("dummy_arch")))
def test_general_plugin_registration_is_visible_in_a_separate_engine_core_process(pool):
    """The engine-core process must resolve the out-of-tree architecture by itself."""
    child = engine_core_child_result(pool["dummy_arch_engine_core"].result())
    assert child["tokens"] == [7, 7, 7]  # the plugin model's favoured token
    # The engine-core process loads its groups and not the front end's.
    groups = child["groups"]
    assert "pagellm.general_plugins" in groups and "pagellm.scheduler_policies" in groups
    assert "pagellm.io_processor_plugins" not in groups
    assert "pagellm.stat_logger_plugins" not in groups


DUMMY_PLATFORM = {"PAGELLM_DUMMY_PLATFORM": "1"}


@scenarios(
    dummy_int8_generate=(
        GENERATE,
        DUMMY_PLATFORM,
        Model("llama3"),
        "{'quantization': 'dummy_int8'}",
    ),
    dummy_int8_engine_core=engine_core_child_call(
        Model("llama3"), DUMMY_PLATFORM, quantization="dummy_int8"
    ),
)
def test_engine_core_process_loads_the_platform_backend_and_quantization_of_its_config(pool):
    """The config crosses the process boundary resolved; the engine-core process still finds the
    plugins it names (platform, attention backend, quantization method) on its own."""
    reference = pool["dummy_int8_generate"].result()
    child = engine_core_child_result(pool["dummy_int8_engine_core"].result())
    assert reference.returncode == 0, reference.stderr
    assert (child["backend"], child["platform"]) == ("DUMMY_ATTN", "dummy")
    # In process, the same prompt and greedy decoding: the child's 3 tokens start its 4.
    assert child["tokens"] == json.loads(reference.stdout.split(" ", 3)[3])[:3]
    for group in (
        "pagellm.platform_plugins",
        "pagellm.attention_backends",
        "pagellm.quantization_methods",
    ):
        assert group in child["groups"]


@scenarios(
    plain_generate=PLAIN_GENERATE, dummy_generate=(GENERATE, DUMMY_PLATFORM, Model("llama3"))
)
def test_active_platform_plugin_is_selected_and_ranks_its_backend_first(pool):
    reference, proc = pool["plain_generate"].result(), pool["dummy_generate"].result()
    assert proc.returncode == 0, proc.stderr
    name, backend, block_size, *tokens = proc.stdout.split()
    assert (name, backend, block_size) == (
        "dummy",
        "DUMMY_ATTN",
        "32",
    )  # block size follows the backend
    assert tokens == reference.stdout.splitlines()[0].split()[3:]


BOTH = {"PAGELLM_DUMMY_PLATFORM": "1", "PAGELLM_DUMMY_PLATFORM_B": "1"}


@scenarios(
    both_platforms=(GENERATE, BOTH, Model("llama3")),
    both_platforms_b=(GENERATE, {**BOTH, "PAGELLM_PLATFORM": "dummy_b"}, Model("llama3")),
    both_platforms_cpu=(GENERATE, {**BOTH, "PAGELLM_PLATFORM": "cpu"}, Model("llama3")),
)
def test_several_active_platforms_need_an_explicit_choice(pool):
    proc, chosen, cpu = (pool[f"both_platforms{k}"].result() for k in ("", "_b", "_cpu"))
    assert proc.returncode != 0 and "Several platforms are active (dummy, dummy_b)" in proc.stderr
    assert chosen.returncode == 0, chosen.stderr
    assert chosen.stdout.split()[0] == "dummy_b"
    assert cpu.stdout.split()[0] == "cpu"


FORCED = "{'attention_backend': 'DUMMY_ATTN'}"
SELECT_FOR_TPU = """
import torch
from pagellm.attention.selector import select_attention_backend
select_attention_backend(requested=None, ranking=["DUMMY_ATTN"], device_type="tpu", head_size=16,
                         dtype=torch.float32, block_size=None, sliding_window=None)
"""


@scenarios(
    forced=(GENERATE, None, Model("llama3"), FORCED),
    bad_block=(GENERATE, None, Model("llama3"), FORCED[:-1] + ", 'block_size': 16}"),
    window=(GENERATE, None, Model("mistral"), FORCED),
    # With the dummy platform active, a sliding-window model falls back to the next ranked
    # backend.
    fallback=(
        "import logging\nlogging.basicConfig(level=logging.INFO)\n" + GENERATE,
        DUMMY_PLATFORM,
        Model("mistral"),
    ),
    nothing_fits=(SELECT_FOR_TPU, None),
)
def test_attention_backend_override_and_rejections_are_explained(pool):
    forced, bad_block, window, fallback, nothing_fits = (
        pool[name].result()
        for name in ("forced", "bad_block", "window", "fallback", "nothing_fits")
    )
    assert forced.returncode == 0, forced.stderr
    assert forced.stdout.split()[1:3] == ["DUMMY_ATTN", "32"]
    assert "block_size 16 not supported (supports multiples of 32)" in bad_block.stderr
    assert "sliding window attention not supported" in window.stderr
    assert fallback.stdout.split()[0:2] == ["dummy", "TORCH_SDPA"]
    # One start-up line says what was chosen and what was passed over, and why.
    assert (
        "Platform dummy: attention backend TORCH_SDPA, block size 16, dtype float32; "
        "DUMMY_ATTN rejected: sliding window attention not supported" in fallback.stderr
    )
    assert "TORCH_SDPA: device 'tpu' not supported" in nothing_fits.stderr
    assert "DUMMY_ATTN: device 'tpu' not supported" in nothing_fits.stderr


QUANTIZED_LINEARS = GENERATE + textwrap.dedent("""
    from pagellm.layers.linear import Linear
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    print(sorted({type(m.linear_method).__name__ for m in linears}), {str(m.qweight.dtype) for m in linears})
""")


@scenarios(
    dummy_int8=(QUANTIZED_LINEARS, None, Model("llama3"), "{'quantization': 'dummy_int8'}"),
    bitsandbytes=(GENERATE, None, Model("llama3"), "{'quantization': 'bitsandbytes'}"),
)
def test_quantization_method_from_plugin_by_name(pool):
    proc, unknown = pool["dummy_int8"].result(), pool["bitsandbytes"].result()
    assert proc.returncode == 0, proc.stderr
    assert "['Int8WeightOnlyLinearMethod'] {'torch.int8'}" in proc.stdout
    assert (
        "Quantization method 'bitsandbytes' is not installed; installed: dummy_int8"
        in unknown.stderr
    )


@scenarios(plain_generate=PLAIN_GENERATE)
def test_front_end_groups_fill_their_registries_in_the_front_end(pool):
    proc = pool["plain_generate"].result()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("HI CollectingStatLogger")


IDEMPOTENT = """
import pagellm
from pagellm.plugins import load_general_plugins
from pagellm.plugins.loader import loaded_records
before = dict(loaded_records())
first = load_general_plugins()
second = load_general_plugins()
print(before == {}, first is second, len([r for r in first if r.status == "loaded"]))
"""


@scenarios(idempotent=(IDEMPOTENT, None))
def test_loading_is_idempotent_and_import_loads_nothing(pool):
    proc = pool["idempotent"].result()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True", "1"]
