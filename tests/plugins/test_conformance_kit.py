"""The conformance kit (`pagellm.testing.conformance`) run as a vendor runs it: ``pytest
--pagellm-platform NAME --pagellm-backend NAME`` in a fresh process, from a directory of its own,
against really installed plugins.

The first-party plugins pass it: the CUDA platform with FLASHINFER and FLASH_ATTN (inactive and
unavailable here, so their declarations, selection and metadata are checked and the device cases
skip, saying why), TRITON_ATTN (in Triton's interpreter), and the ROCm platform twice: inactive as
it is here, and active on the faked gfx942 of pagellm-rocm's ``fake_hardware`` (the cases that
need no device run against it, with TRITON_ATTN compiled-mode declarations on ROCm's device
type). So do the test packages (the dummy platform and attention backend, the docs' example). The deliberately broken backend
(tests/plugins/broken_attention) fails it, each case with a message naming what differed.

The runs start ahead, two at a time, longest first: each is mostly one core's work.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from editable_installs import editable_installs

PACKAGES = [
    Path(__file__).parent / name
    for name in ("dummy_platform", "dummy_attention", "doc_example", "broken_attention")
]
CONTROL_VARS = ("VLLM_PLUGINS", "PAGELLM_PLUGINS_STRICT", "PAGELLM_PLATFORM", "TRITON_INTERPRET")
NO_PLATFORM = "no --pagellm-platform given"
RUNS = {  # name: (pytest arguments, environment)
    "triton": (["--pagellm-backend", "TRITON_ATTN"], {"TRITON_INTERPRET": "1"}),
    "cuda": (
        ["--pagellm-platform", "cuda", "--pagellm-backend", "FLASHINFER"]
        + ["--pagellm-backend", "FLASH_ATTN"],
        {},
    ),
    "rocm": (["--pagellm-platform", "rocm"], {}),
    # Without TRITON_INTERPRET (CONTROL_VARS): TRITON_ATTN as on a GPU, declaring "cuda" only.
    "rocm_faked": (
        ["--pagellm-platform", "rocm", "--pagellm-backend", "TRITON_ATTN"]
        + ["--pagellm-fake-hardware", "pagellm_rocm.fake_hardware:gfx942"],
        {},
    ),
    "dummy": (
        ["--pagellm-platform", "dummy", "--pagellm-backend", "DUMMY_ATTN"],
        {"PAGELLM_DUMMY_PLATFORM": "1"},
    ),
    "doc_example": (
        ["--pagellm-platform", "plain_cpu", "--pagellm-backend", "PLAIN_TORCH"],
        {"PAGELLM_PLAIN_CPU": "1"},
    ),
    # Loaded by name as well as by its entry point: the same plugin, registered once.
    "broken": (["-p", "pagellm.testing.conformance", "--pagellm-backend", "BROKEN_ATTN"], {}),
}


@dataclass
class KitRun:
    returncode: int
    output: str
    cases: dict[str, tuple[str, str]]
    """Case id (module::name[params]) → (passed / failed / skipped, message)."""
    properties: dict[str, dict[str, str]]
    """Case id → what it recorded (``record_property``)."""

    def named(self, status: str, prefix: str = "") -> dict[str, str]:
        return {
            case: message
            for case, (s, message) in self.cases.items()
            if s == status and case.startswith(prefix)
        }


def run_kit(args: list[str], env: dict[str, str], directory: Path) -> KitRun:
    directory.mkdir()
    full_env = {k: v for k, v in os.environ.items() if k not in CONTROL_VARS}
    report = directory / "report.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
        + args,
        env={**full_env, "OMP_NUM_THREADS": "1", **env},
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=600,
    )
    cases, properties = {}, {}
    if report.exists():
        for case in ElementTree.parse(report).iter("testcase"):
            module = case.get("classname", "").rpartition(".")[2]
            name = f"{module}.py::{case.get('name')}"
            status, message = "passed", ""
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    status = "skipped" if child.tag == "skipped" else "failed"
                    message = child.get("message", "")
            cases[name] = (status, message)
            properties[name] = {
                str(p.get("name")): str(p.get("value")) for p in case.iter("property")
            }
    return KitRun(proc.returncode, proc.stdout + proc.stderr, cases, properties)


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[KitRun]]]:
    root = tmp_path_factory.mktemp("kit")
    with editable_installs(PACKAGES), ThreadPoolExecutor(max_workers=2) as pool:
        runs = {
            name: pool.submit(run_kit, args, env, root / name) for name, (args, env) in RUNS.items()
        }
        yield runs
        for future in runs.values():
            future.cancel()


def green(kit: dict[str, Future[KitRun]], name: str) -> KitRun:
    run = kit[name].result()
    assert run.returncode == 0, run.output[-6000:]
    assert run.cases, run.output[-3000:]
    return run


def test_triton_attn_passes_the_kit_in_the_interpreter(kit):
    run = green(kit, "triton")
    skipped = run.named("skipped")
    assert skipped and set(skipped.values()) == {NO_PLATFORM}, skipped
    passed = run.named("passed")
    # Every declared head size (7) runs, and the device cases ran rather than skipped.
    assert len(run.named("passed", "test_declarations.py::test_declared_head_size_runs")) == 7
    for case in (
        "test_attention.py::test_kv_written_at_their_slots_and_read_back[TRITON_ATTN-fp8_e4m3]",
        "test_attention.py::test_sliding_window_matches_the_reference[TRITON_ATTN]",
        "test_cudagraphs.py::test_decode_steps_replayed_from_graph_metadata_match[TRITON_ATTN]",
        "test_end_to_end.py::test_backend_greedy_tokens_match_the_reference[TRITON_ATTN]",
        "test_package.py::test_backend_declares_a_plugin_api_this_pagellm_accepts[TRITON_ATTN]",
    ):
        assert case in passed, case


def test_cuda_platform_flashinfer_and_flash_attn_pass_what_runs_without_a_gpu(kit):
    run = green(kit, "cuda")
    passed, skipped = run.named("passed"), run.named("skipped")
    for case in (
        "test_package.py::test_platform_class_fits_the_platform_interface",
        "test_cudagraphs.py::test_platform_turns_graphs_on_only_as_declared",
        "test_declarations.py::test_platform_ranking_serves_a_typical_model[128]",
        "test_package.py::test_backend_is_an_installed_plugin_that_loads[FLASHINFER]",
        "test_package.py::test_backend_classes_fit_their_interfaces[FLASH_ATTN]",
        "test_declarations.py::test_undeclared_value_is_refused_with_a_reason[FLASHINFER-dtype_float32]",
        "test_declarations.py::test_declared_head_size_is_accepted[FLASHINFER-256]",
        "test_cudagraphs.py::test_backend_declaring_graphs_builds_graph_metadata[FLASH_ATTN]",
    ):
        assert case in passed, case
    decode = skipped["test_attention.py::test_decode_matches_the_reference[FLASHINFER]"]
    assert "platform 'cuda' is inactive" in decode and "cannot force it on" in decode
    assert "FLASHINFER is not available here: flashinfer is not installed" in decode
    graphs = skipped["test_cudagraphs.py::test_platform_records_and_replays_a_graph"]
    assert "inactive" in graphs


def test_rocm_platform_passes_what_runs_without_an_amd_gpu(kit):
    """No AMD GPU here: the ROCm platform is inactive (torch is not a ROCm build), so its class,
    package and plugin API are checked and the cases needing it active skip, saying why. Its
    decisions with faked hardware facts are pagellm-rocm's own tests."""
    run = green(kit, "rocm")
    passed, skipped = run.named("passed"), run.named("skipped")
    assert "test_package.py::test_platform_class_fits_the_platform_interface" in passed
    graphs = skipped["test_cudagraphs.py::test_platform_records_and_replays_a_graph"]
    assert "platform 'rocm' is inactive" in graphs


def test_rocm_platform_on_faked_gfx942_passes_what_needs_no_device(kit):
    """pagellm-rocm's fake (torch.version.hip and a stand-in amdsmi listing one gfx942; nothing
    of torch.cuda) makes the ROCm platform active: its declarations, dtype="auto", the ranking
    (TRITON_ATTN chosen), the decode-graph decisions, TRITON_ATTN's declarations on ROCm's device
    type and both plugins' metadata run against it; every case that would run on the device
    skips, saying the hardware is faked."""
    run = green(kit, "rocm_faked")
    passed, skipped = run.named("passed"), run.named("skipped")
    for case in (
        "test_package.py::test_faked_hardware_makes_the_platform_active",
        "test_package.py::test_platform_class_fits_the_platform_interface",
        "test_declarations.py::test_platform_auto_dtype_is_one_it_supports",
        "test_cudagraphs.py::test_platform_turns_graphs_on_only_as_declared",
        "test_declarations.py::test_declared_kv_cache_dtype_is_accepted[TRITON_ATTN-fp8_e4m3]",
        "test_declarations.py::test_undeclared_value_is_refused_with_a_reason[TRITON_ATTN-device_type_cpu]",
        "test_cudagraphs.py::test_backend_declaring_graphs_builds_graph_metadata[TRITON_ATTN]",
    ):
        assert case in passed, case
    for size in (64, 128):
        case = f"test_declarations.py::test_platform_ranking_serves_a_typical_model[{size}]"
        assert case in passed and run.properties[case] == {"backend": "TRITON_ATTN"}
    faked = "platform 'rocm' is active on faked hardware (torch.version.hip '6.4.43482'"
    assert skipped and all(faked in message for message in skipped.values()), skipped
    for case in (
        "test_cudagraphs.py::test_platform_records_and_replays_a_graph",
        "test_end_to_end.py::test_platform_greedy_tokens_match_the_reference",
        "test_attention.py::test_decode_matches_the_reference[TRITON_ATTN]",
    ):
        assert case in skipped, case


@pytest.mark.parametrize("name", ["dummy", "doc_example"])
def test_test_packages_pass_the_kit(kit, name):
    run = green(kit, name)
    passed = run.named("passed")
    assert "test_end_to_end.py::test_platform_greedy_tokens_match_the_reference" in passed
    assert "test_package.py::test_platform_class_fits_the_platform_interface" in passed
    assert not any(NO_PLATFORM in m for m in run.named("skipped").values())
    if name == "dummy":  # it declares no sliding window: refused with the reason, not run
        window = "DUMMY_ATTN-a_sliding_window"
        assert (
            f"test_declarations.py::test_undeclared_value_is_refused_with_a_reason[{window}]"
            in passed
        )
        message = run.cases[
            "test_attention.py::test_sliding_window_matches_the_reference[DUMMY_ATTN]"
        ]
        assert message == ("skipped", "DUMMY_ATTN declares supports_sliding_window = False")


def test_broken_backend_fails_the_kit_naming_each_broken_declaration(kit):
    run = kit["broken"].result()
    assert run.returncode == 1, run.output[-3000:]
    failed = run.named("failed")
    head_64 = failed.pop("test_declarations.py::test_declared_head_size_runs[BROKEN_ATTN-64]")
    assert "mixed batch: BROKEN_ATTN, step 1 of 2" in head_64
    assert "heads of size 64" in head_64 and "differs from TORCH_SDPA" in head_64
    assert "the largest at token" in head_64
    block_32 = failed.pop(
        "test_declarations.py::test_declared_block_size_is_accepted[BROKEN_ATTN-32]"
    )
    assert (
        "declares block sizes that are multiples of 16, yet the selector refuses block size 32"
        in block_32
    )
    graphs = failed.pop(
        "test_cudagraphs.py::test_backend_declaring_graphs_builds_graph_metadata[BROKEN_ATTN]"
    )
    assert "declares cudagraph_support = True" in graphs and "build_for_cudagraph" in graphs
    assert not failed, failed  # nothing else is broken: the other cases pass or skip
    passed = run.named("passed")
    assert "test_declarations.py::test_declared_head_size_runs[BROKEN_ATTN-32]" in passed
    assert (
        "test_end_to_end.py::test_backend_greedy_tokens_match_the_reference[BROKEN_ATTN]" in passed
    )
    # The summary a vendor reads names each failing case.
    assert "FAILED test_declarations.py::test_declared_head_size_runs[BROKEN_ATTN-64]" in run.output


class _Config:
    """What `enter_faked_hardware` asks of pytest's config."""

    def __init__(self) -> None:
        self.cleanups: list = []

    def add_cleanup(self, cleanup) -> None:
        self.cleanups.append(cleanup)


def test_fake_hardware_needs_a_platform_and_a_context_manager_factory():
    from pagellm.testing.conformance.faked_hardware import enter_faked_hardware

    spec, config = "pagellm_rocm.fake_hardware:gfx942", _Config()
    with pytest.raises(pytest.UsageError, match="name the platform with --pagellm-platform"):
        enter_faked_hardware(config, spec, None)
    with pytest.raises(pytest.UsageError, match="ModuleNotFoundError: No module named 'nowhere'"):
        enter_faked_hardware(config, "nowhere:gfx942", "rocm")
    with pytest.raises(pytest.UsageError, match="names no callable"):
        enter_faked_hardware(config, "pagellm_rocm.fake_hardware", "rocm")
    assert enter_faked_hardware(config, None, "rocm") is None and not config.cleanups
