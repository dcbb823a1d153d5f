"""The plugin system against really installed plugin packages (tests/plugins/*, `pip install -e`).

Plugin loading is once per process, so each scenario runs in a fresh Python process with its own
environment (VLLM_PLUGINS, PAGELLM_PLUGINS_STRICT, the dummy platform's switches).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from editable_installs import editable_installs

PLUGIN_DIRS = sorted(p for p in Path(__file__).parent.iterdir() if (p / "pyproject.toml").exists())
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


def start(code: str, env: dict[str, str] | None = None, *args: str) -> subprocess.Popen:
    full_env = {k: v for k, v in os.environ.items() if k not in CONTROL_VARS}
    full_env.update(env or {})
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run(code: str, env: dict[str, str] | None = None, *args: str) -> subprocess.CompletedProcess:
    return finish(start(code, env, *args))


def run_together(*calls: tuple) -> list[subprocess.CompletedProcess]:
    """`run` of each (code, env, *args), the processes started together: they are independent,
    and each mostly imports (one core), so a 2-core machine runs two in the time of one."""
    return [finish(proc) for proc in [start(*call) for call in calls]]


PLUGINS_CLI = "from pagellm.entrypoints.cli import main; raise SystemExit(main(sys.argv[1:]))"


def plugins_json_call(env: dict[str, str] | None = None) -> tuple:
    """`run`'s arguments for ``pagellm plugins --json``."""
    return ("import sys\n" + PLUGINS_CLI, env, "plugins", "--json")


def plugins_json(env: dict[str, str] | None = None) -> dict:
    return parse_plugins_json(run(*plugins_json_call(env)))


def parse_plugins_json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    return {group: {r["name"]: r for r in records} for group, records in report.items()}


@pytest.fixture(scope="module")
def default_report() -> dict:
    """``pagellm plugins --json`` with no allowlist: the same for each test that reads it."""
    return plugins_json()


GENERATE = """
import sys
from pagellm import LLM, SamplingParams
llm = LLM(sys.argv[1], max_model_len=64, kv_cache_memory=4 << 20, **eval(sys.argv[2] if len(sys.argv) > 2 else "{}"))
out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
cfg = llm.llm_engine.config
from pagellm.platforms import current_platform
print(current_platform.name, cfg.attention_backend, cfg.cache.block_size, out[0].outputs[0].token_ids)
"""


def test_plugins_json_reports_each_plugin_with_distribution_status_and_reason(default_report):
    report = default_report
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
    assert "2.0" in future and "1.2" in future
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


def test_plugins_command_prints_a_table_per_group_and_plugins_log_at_info():
    proc = run("import sys\n" + PLUGINS_CLI, {"PAGELLM_DUMMY_PLATFORM": "1"}, "plugins")
    assert proc.returncode == 0
    assert "pagellm.general_plugins" in proc.stdout
    assert "broken_import" in proc.stdout and "failed" in proc.stdout
    assert "Traceback" in proc.stderr  # the failure is logged with its traceback
    # The plugin's own logger shows at the level the CLI gives pagellm's loggers.
    assert "INFO pagellm_dummy_platform.plugin: dummy hardware found" in proc.stderr


def test_vllm_style_entry_points_and_groups_are_answered_with_the_fix(default_report):
    report = default_report
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


def test_misregistered_classes_are_reported_by_plugin_name(default_report):
    attention = default_report["pagellm.attention_backends"]
    misnamed = attention["misnamed_backend"]
    assert misnamed["status"] == "misregistered"
    assert "'SDPA_ALIAS'" in misnamed["reason"] and "its name is 'TORCH_SDPA'" in misnamed["reason"]
    assert attention["dummy_attn"]["status"] == "loaded"
    platforms = plugins_json({"PAGELLM_BROKEN_PLATFORMS": "1"})["pagellm.platform_plugins"]
    bad_path = platforms["bad_path"]
    assert bad_path["status"] == "misregistered"
    assert "pagellm_broken_plugin.no_such_module.Platform" in bad_path["reason"]
    assert "does not import: ModuleNotFoundError" in bad_path["reason"]
    assert platforms["bad_signature"]["status"] == "misregistered"
    assert "does not fit Platform" in platforms["bad_signature"]["reason"]
    assert platforms["dummy"]["reason"].startswith("inactive")


def test_platform_with_a_wrong_signature_is_refused_when_chosen_naming_the_plugin(tiny_models):
    env = {"PAGELLM_BROKEN_PLATFORMS": "1", "PAGELLM_PLATFORM": "bad_signature"}
    proc = run(GENERATE, env, tiny_models["llama3"])
    assert proc.returncode != 0
    assert "PluginError: Platform 'bad_signature'" in proc.stderr
    assert "from plugin 'bad_signature' of pagellm-broken-plugin" in proc.stderr
    assert (
        "available_kv_cache_memory(config, model_bytes) cannot be called as "
        "Platform.available_kv_cache_memory(config, model_bytes, profile_run)" in proc.stderr
    )
    assert "synchronize is a method, Platform.synchronize is a class method" in proc.stderr
    assert "TypeError" not in proc.stderr


def test_broken_plugins_are_logged_and_llm_still_generates(tiny_models):
    proc = run(GENERATE, None, tiny_models["llama3"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0:3] == ["cpu", "TORCH_SDPA", "16"]
    assert "broken_import" in proc.stderr and "pagellm_missing_dependency" in proc.stderr


BROKEN_GENERAL = ("broken_import", "misspelled_hook", "wrong_args", "future_api", "function_value")


def test_strict_mode_fails_start_up_naming_every_failed_plugin(tiny_models):
    strict = {"PAGELLM_PLUGINS_STRICT": "1"}
    proc, cli = run_together(
        (GENERATE, strict, tiny_models["llama3"]), ("import sys\n" + PLUGINS_CLI, strict, "plugins")
    )
    assert proc.returncode != 0
    error = proc.stderr.splitlines()[-1]
    assert error.startswith("pagellm.plugins.loader.PluginError: 5 plugin(s) of group")
    assert all(f"'{name}'" in error for name in BROKEN_GENERAL)
    assert "PAGELLM_PLUGINS_STRICT=1" in error
    assert cli.returncode == 2
    error = cli.stderr[cli.stderr.index("pagellm: error:") :]
    assert all(f"'{name}'" in error for name in (*BROKEN_GENERAL, "misnamed_backend"))


def test_empty_allowlist_loads_nothing_and_runs_on_builtin_cpu_and_reference_backend(tiny_models):
    report_proc, proc = run_together(
        plugins_json_call({"VLLM_PLUGINS": ""}),
        (GENERATE, {"VLLM_PLUGINS": "", "PAGELLM_DUMMY_PLATFORM": "1"}, tiny_models["llama3"]),
    )
    report = parse_plugins_json(report_proc)
    records = [r for group in report.values() for r in group.values() if not _own_or_ignored(r)]
    assert records and all(r["status"] == "skipped" for r in records)
    assert all(r["reason"] == "not in the VLLM_PLUGINS allowlist" for r in records)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0:2] == ["cpu", "TORCH_SDPA"]
    assert "WARNING" not in proc.stderr and "ERROR" not in proc.stderr


def _own_or_ignored(record: dict) -> bool:
    """pagellm's own plugins load whatever the allowlist says; ignored ones never load."""
    return record["distribution"] == "pagellm" or record["status"] == "ignored"


def test_allowlist_loads_only_the_named_plugins_and_tells_not_installed_names_apart():
    report = plugins_json({"VLLM_PLUGINS": "dummy_model,dummy_attn,dummy_endpoint,no_such_plugin"})
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


def test_endpoint_plugins_are_deny_by_default_and_need_matching_tasks():
    code = """
    import json, logging, sys
    logging.basicConfig(level=logging.INFO)
    from pagellm.plugins import load_endpoint_plugins
    endpoints = json.loads(sys.argv[1])
    enabled = load_endpoint_plugins(endpoints, {"generate"})
    # A plugin API 1.0 plugin: the API server attaches it as attach(app, engine_client).
    assert all(plugin.api_version == "1.0" for _, plugin in enabled)
    print(json.dumps([name for name, _ in enabled]))
    """

    cases = [
        (None, None),
        (["not_installed_endpoint"], None),
        (["dummy_endpoint"], None),
        (["dummy_endpoint", "embed_endpoint"], None),
        # VLLM_PLUGINS, when set, is the allowlist whatever the serve command enables.
        (["dummy_endpoint"], {"VLLM_PLUGINS": "dummy_model"}),
        (None, {"VLLM_PLUGINS": "dummy_endpoint"}),
    ]
    procs = run_together(*((code, env, json.dumps(endpoints)) for endpoints, env in cases))
    assert all(proc.returncode == 0 for proc in procs), [proc.stderr for proc in procs]
    served = [json.loads(proc.stdout) for proc in procs]
    assert served == [[], [], ["dummy_endpoint"], ["dummy_endpoint"], [], ["dummy_endpoint"]]
    log = procs[3].stderr
    assert "embed_endpoint" in log and "required_tasks ['embed']" in log


def make_dummy_arch_model(tiny_models, tmp_path) -> str:
    import shutil

    target = tmp_path / "dummy-arch"
    shutil.copytree(tiny_models["llama3"], target)
    config = json.loads((target / "config.json").read_text())
    config["architectures"] = ["DummyLlamaForCausalLM"]
    (target / "config.json").write_text(json.dumps(config))
    return str(target)


def test_out_of_tree_model_from_general_plugin_is_usable_by_llm(tiny_models, tmp_path):
    model = make_dummy_arch_model(tiny_models, tmp_path)
    proc, refused = run_together((GENERATE, None, model), (GENERATE, {"VLLM_PLUGINS": ""}, model))
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


def start_engine_core_child(
    model: str, env: dict[str, str] | None = None, **kwargs
) -> subprocess.Popen:
    """The front end resolves the config; a spawned engine-core process (a fresh interpreter that
    never saw the front end's registrations) builds the engine from it and runs one request."""
    return start(ENGINE_CORE_CHILD, env, model, str(Path(__file__).parent), repr(kwargs))


def engine_core_child_result(proc: subprocess.Popen) -> dict:
    """What `start_engine_core_child` reports: the config's backend, the child's platform, its
    tokens and the plugin groups it loaded."""
    proc = finish(proc)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["exitcode"] == 0
    return result


def test_general_plugin_registration_is_visible_in_a_separate_engine_core_process(
    tiny_models, tmp_path
):
    """The engine-core process must resolve the out-of-tree architecture by itself."""
    model = make_dummy_arch_model(tiny_models, tmp_path)
    child = engine_core_child_result(start_engine_core_child(model))
    assert child["tokens"] == [7, 7, 7]  # the plugin model's favoured token
    # The engine-core process loads its groups and not the front end's.
    groups = child["groups"]
    assert "pagellm.general_plugins" in groups and "pagellm.scheduler_policies" in groups
    assert "pagellm.io_processor_plugins" not in groups
    assert "pagellm.stat_logger_plugins" not in groups


def test_engine_core_process_loads_the_platform_backend_and_quantization_of_its_config(
    tiny_models,
):
    """The config crosses the process boundary resolved; the engine-core process still finds the
    plugins it names (platform, attention backend, quantization method) on its own."""
    env = {"PAGELLM_DUMMY_PLATFORM": "1"}
    # Both at once: the two processes are independent.
    reference_proc = start(GENERATE, env, tiny_models["llama3"], "{'quantization': 'dummy_int8'}")
    child_proc = start_engine_core_child(tiny_models["llama3"], env, quantization="dummy_int8")
    reference, child = finish(reference_proc), engine_core_child_result(child_proc)
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


def test_active_platform_plugin_is_selected_and_ranks_its_backend_first(tiny_models):
    reference, proc = run_together(
        (GENERATE, None, tiny_models["llama3"]),
        (GENERATE, {"PAGELLM_DUMMY_PLATFORM": "1"}, tiny_models["llama3"]),
    )
    assert proc.returncode == 0, proc.stderr
    name, backend, block_size, *tokens = proc.stdout.split()
    assert (name, backend, block_size) == (
        "dummy",
        "DUMMY_ATTN",
        "32",
    )  # block size follows the backend
    assert tokens == reference.stdout.split()[3:]


def test_several_active_platforms_need_an_explicit_choice(tiny_models):
    both = {"PAGELLM_DUMMY_PLATFORM": "1", "PAGELLM_DUMMY_PLATFORM_B": "1"}
    proc, chosen, cpu = run_together(
        (GENERATE, both, tiny_models["llama3"]),
        (GENERATE, {**both, "PAGELLM_PLATFORM": "dummy_b"}, tiny_models["llama3"]),
        (GENERATE, {**both, "PAGELLM_PLATFORM": "cpu"}, tiny_models["llama3"]),
    )
    assert proc.returncode != 0 and "Several platforms are active (dummy, dummy_b)" in proc.stderr
    assert chosen.returncode == 0, chosen.stderr
    assert chosen.stdout.split()[0] == "dummy_b"
    assert cpu.stdout.split()[0] == "cpu"


def test_attention_backend_override_and_rejections_are_explained(tiny_models):
    logged = "import logging\nlogging.basicConfig(level=logging.INFO)\n" + GENERATE
    forced, bad_block, window, fallback, nothing_fits = run_together(
        (GENERATE, None, tiny_models["llama3"], "{'attention_backend': 'DUMMY_ATTN'}"),
        (
            GENERATE,
            None,
            tiny_models["llama3"],
            "{'attention_backend': 'DUMMY_ATTN', 'block_size': 16}",
        ),
        (GENERATE, None, tiny_models["mistral"], "{'attention_backend': 'DUMMY_ATTN'}"),
        # With the dummy platform active, a sliding-window model falls back to the next ranked
        # backend.
        (logged, {"PAGELLM_DUMMY_PLATFORM": "1"}, tiny_models["mistral"]),
        (
            """
    import torch
    from pagellm.attention.selector import select_attention_backend
    select_attention_backend(requested=None, ranking=["DUMMY_ATTN"], device_type="tpu", head_size=16,
                             dtype=torch.float32, block_size=None, sliding_window=None)
    """,
        ),
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


def test_quantization_method_from_plugin_by_name(tiny_models):
    code = (
        GENERATE
        + """
    from pagellm.layers.linear import Linear
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    print(sorted({type(m.linear_method).__name__ for m in linears}), {str(m.qweight.dtype) for m in linears})
    """.replace("\n    ", "\n")
    )
    proc, unknown = run_together(
        (code, None, tiny_models["llama3"], "{'quantization': 'dummy_int8'}"),
        (GENERATE, None, tiny_models["llama3"], "{'quantization': 'bitsandbytes'}"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "['Int8WeightOnlyLinearMethod'] {'torch.int8'}" in proc.stdout
    assert (
        "Quantization method 'bitsandbytes' is not installed; installed: dummy_int8"
        in unknown.stderr
    )


def test_front_end_groups_fill_their_registries_in_the_front_end(tiny_models):
    code = (
        GENERATE
        + """
    from pagellm.io_processors import io_processors
    from pagellm.metrics.registry import stat_loggers
    print(io_processors.get("upper_text")().process_input("hi"), stat_loggers.get("collecting").__name__)
    """.replace("\n    ", "\n")
    )
    proc = run(code, None, tiny_models["llama3"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("HI CollectingStatLogger")


def test_loading_is_idempotent_and_import_loads_nothing():
    proc = run("""
    import pagellm
    from pagellm.plugins import load_general_plugins
    from pagellm.plugins.loader import loaded_records
    before = dict(loaded_records())
    first = load_general_plugins()
    second = load_general_plugins()
    print(before == {}, first is second, len([r for r in first if r.status == "loaded"]))
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True", "1"]


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


def test_scheduling_policy_from_a_plugin_orders_admission_in_process_and_in_the_engine_core(
    tiny_models,
):
    proc = run(POLICY_ORDER, None, tiny_models["llama3"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "fcfs False first long short",
        "fcfs True first long short",
        "shortest_prompt_first False first short long",
        "shortest_prompt_first True first short long",
        "Scheduling policy 'nope' is not installed; installed: fcfs, priority, "
        "shortest_prompt_first.",
    ]
