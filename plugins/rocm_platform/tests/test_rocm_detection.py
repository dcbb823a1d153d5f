"""Detecting AMD GPUs, and the CUDA and ROCm platforms never being active together.

No AMD GPU (and no ROCm build of torch) exists where these run, so the facts a ROCm machine would
report are faked: ``torch.version.hip`` (monkeypatched), the ``amdsmi`` module (a stand-in in
``sys.modules``, or one that fails at ``amdsmi_init`` as the package index's wrapper does without
AMD's library), the driver's sysfs topology (files in a temporary directory) and torch's device
properties. The rest — the plugin hooks, the visible-device rules, the platform's answers — is
the real code. ``pagellm plugins`` itself is run for real at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pagellm_cuda.plugin as cuda_plugin
import pagellm_rocm.plugin as rocm_plugin
import pytest
import torch
from pagellm_rocm import detection
from pagellm_rocm.arch import UnknownArchitectureError, parse_arch
from pagellm_rocm.detection import PhysicalGpus, detect, probe_amdsmi, probe_sysfs
from pagellm_rocm.platform import RocmPlatform
from pagellm_rocm.visible import CUDA_VAR, HIP_VAR, ROCR_VAR, RocmVisibleDevicesError

ROCM_CLASS = "pagellm_rocm.platform:RocmPlatform"
CUDA_CLASS = "pagellm_cuda.platform:CudaPlatform"
VARS = (HIP_VAR, CUDA_VAR, ROCR_VAR)


def fake_amdsmi(archs: list[str], fail_init: Exception | None = None) -> types.ModuleType:
    """An ``amdsmi`` module listing GPUs of ``archs``; it records init and shutdown calls."""
    module = types.ModuleType("amdsmi")
    module.calls = []  # type: ignore[attr-defined]

    def amdsmi_init() -> None:
        module.calls.append("init")  # type: ignore[attr-defined]
        if fail_init is not None:
            raise fail_init

    module.amdsmi_init = amdsmi_init  # type: ignore[attr-defined]
    module.amdsmi_shut_down = lambda: module.calls.append("shut_down")  # type: ignore
    module.amdsmi_get_processor_handles = lambda: list(range(len(archs)))  # type: ignore
    module.amdsmi_get_gpu_asic_info = lambda h: {  # type: ignore[attr-defined]
        "target_graphics_version": archs[h],
        "market_name": "AMD Instinct MI300X",
    }
    return module


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch):
    """Each test sees no visible-device variable and asks the hardware afresh; what the plugin
    hook sets in the environment is undone afterwards (``setenv`` first: ``delenv`` of an unset
    variable records nothing to restore)."""
    for var in VARS:
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    detection.physical_gpus.cache_clear()
    yield
    detection.physical_gpus.cache_clear()


@pytest.fixture
def no_sysfs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(detection, "KFD_NODES", tmp_path / "absent")


@pytest.fixture
def rocm_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch as a ROCm build reports itself (hip version set, cuda None)."""
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    monkeypatch.setattr(torch.version, "cuda", None)


def with_amdsmi(monkeypatch: pytest.MonkeyPatch, module: types.ModuleType | None) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", module)  # None: the import fails


def write_node(root: Path, index: int, simd_count: int, target_version: int) -> None:
    node = root / str(index)
    node.mkdir(parents=True)
    (node / "properties").write_text(
        f"cpu_cores_count {0 if simd_count else 64}\nsimd_count {simd_count}\n"
        f"gfx_target_version {target_version}\nlds_size_in_kb 64\n"
    )


# ---------------------------------------------------------------------- sources


def test_amdsmi_lists_the_gpus_and_is_shut_down(monkeypatch):
    module = fake_amdsmi(["gfx942", "gfx942"])
    with_amdsmi(monkeypatch, module)
    assert probe_amdsmi() == PhysicalGpus(["gfx942", "gfx942"], "amdsmi")
    assert module.calls == ["init", "shut_down"]


def test_amdsmi_that_cannot_initialise_is_not_available(monkeypatch):
    """The wrapper on the package index imports without AMD's library and fails at init."""
    with_amdsmi(monkeypatch, fake_amdsmi([], fail_init=OSError("libamd_smi.so: not found")))
    reason = probe_amdsmi()
    assert reason == "amdsmi is not available (OSError: libamd_smi.so: not found)"


def test_absent_amdsmi_is_not_available(monkeypatch):
    with_amdsmi(monkeypatch, None)
    assert str(probe_amdsmi()).startswith("amdsmi is not available (ModuleNotFoundError")


def test_sysfs_gpu_nodes_are_counted_and_named(tmp_path):
    write_node(tmp_path, 0, 0, 0)  # the CPU
    write_node(tmp_path, 1, 1216, 90402)
    write_node(tmp_path, 2, 1216, 90402)
    write_node(tmp_path, 10, 192, 110000)  # numeric order, not text order
    assert probe_sysfs(tmp_path) == PhysicalGpus(["gfx942", "gfx942", "gfx1100"], "sysfs")


def test_sysfs_without_gpus_says_why(tmp_path):
    assert "does not exist" in str(probe_sysfs(tmp_path / "absent"))
    write_node(tmp_path, 0, 0, 0)
    assert str(probe_sysfs(tmp_path)).endswith("lists no GPU node")


def test_sysfs_is_the_fallback_when_amdsmi_is_absent(monkeypatch, tmp_path, rocm_torch):
    with_amdsmi(monkeypatch, None)
    write_node(tmp_path, 1, 304, 90010)
    monkeypatch.setattr(detection, "KFD_NODES", tmp_path)
    found = detect({})
    assert (found.physical, found.archs, found.inactive_reason) == ([0], ["gfx90a"], None)


# ---------------------------------------------------------------------- detect and the hook


def test_cpu_torch_is_not_a_rocm_build():
    assert torch.version.hip is None  # this machine's torch: the case under test
    assert detect({}).inactive_reason == "torch is not a ROCm build (torch.version.hip is None)"
    assert rocm_plugin.pagellm_platform() is None
    assert rocm_plugin.pagellm_platform_inactive_reason().startswith("torch is not a ROCm build")


def test_rocm_torch_without_gpus_says_where_it_looked(monkeypatch, rocm_torch, no_sysfs):
    with_amdsmi(monkeypatch, None)
    reason = detect({}).inactive_reason
    assert reason is not None and reason.startswith("no AMD GPU found: amdsmi is not available")
    assert "does not exist" in reason
    assert rocm_plugin.pagellm_platform() is None


def test_rocm_torch_with_gpus_is_active_and_syncs_the_variables(monkeypatch, rocm_torch):
    with_amdsmi(monkeypatch, fake_amdsmi(["gfx942"] * 4))
    monkeypatch.setenv(HIP_VAR, "2,3")
    assert rocm_plugin.pagellm_platform() == ROCM_CLASS
    assert os.environ[CUDA_VAR] == "2,3"
    assert detect().physical == [2, 3]


def test_hidden_gpus_make_the_platform_inactive(monkeypatch, rocm_torch):
    with_amdsmi(monkeypatch, fake_amdsmi(["gfx942"] * 2))
    monkeypatch.setenv(ROCR_VAR, "-1")
    assert rocm_plugin.pagellm_platform() is None
    reason = rocm_plugin.pagellm_platform_inactive_reason()
    assert reason == "no AMD GPU is visible of the 2 present (ROCR_VISIBLE_DEVICES='-1')"


def test_conflicting_variables_fail_the_hook_naming_both(monkeypatch, rocm_torch):
    with_amdsmi(monkeypatch, fake_amdsmi(["gfx942"] * 2))
    monkeypatch.setenv(HIP_VAR, "0")
    monkeypatch.setenv(CUDA_VAR, "1")
    with pytest.raises(RocmVisibleDevicesError, match="HIP_VISIBLE_DEVICES='0' and CUDA_VIS"):
        rocm_plugin.pagellm_platform()


BUILDS = {
    "cpu": dict(hip=None, cuda=None, gpus=0),
    "cuda": dict(hip=None, cuda="12.8", gpus=2),
    "rocm": dict(hip="6.4.43482", cuda=None, gpus=2),
    "hip-and-cuda": dict(hip="6.4.43482", cuda="12.8", gpus=2),
}


@pytest.mark.parametrize("build", list(BUILDS))
def test_cuda_and_rocm_are_never_both_active(monkeypatch, no_sysfs, build):
    """Every kind of torch build, faked with GPUs where it would have them: at most one of the
    two platform hooks names its class, and the other says why it is inactive."""
    facts = BUILDS[build]
    monkeypatch.setattr(torch.version, "hip", facts["hip"])
    monkeypatch.setattr(torch.version, "cuda", facts["cuda"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: facts["gpus"])
    with_amdsmi(monkeypatch, fake_amdsmi(["gfx942"] * facts["gpus"]))
    answers = {
        "cuda": cuda_plugin.pagellm_platform(),
        "rocm": rocm_plugin.pagellm_platform(),
    }
    active = [name for name, answer in answers.items() if answer is not None]
    assert active == {"cpu": [], "cuda": ["cuda"]}.get(build, ["rocm"])
    if answers["cuda"] is None:
        reason = cuda_plugin.pagellm_platform_inactive_reason()
        expected = "torch is a ROCm build" if facts["hip"] else "torch is not a CUDA build"
        assert reason.startswith(expected)
    else:
        assert answers["cuda"] == CUDA_CLASS
        assert rocm_plugin.pagellm_platform_inactive_reason().startswith(
            "torch is not a ROCm build (torch.version.hip is None); it is a CUDA build (12.8)"
        )


# ---------------------------------------------------------------------- the platform's facts


def test_platform_answers_from_the_detected_architecture(monkeypatch, rocm_torch):
    with_amdsmi(monkeypatch, fake_amdsmi(["gfx90a", "gfx942", "gfx942"]))
    monkeypatch.setenv(HIP_VAR, "2,1")
    assert RocmPlatform.device_count() == 2
    assert RocmPlatform.physical_device_id(0) == 2
    assert RocmPlatform.gfx_arch(0) == parse_arch("gfx942")
    assert RocmPlatform.device_capability(1) == (9, 4)
    assert RocmPlatform.default_dtype(torch.float32) == torch.bfloat16
    assert RocmPlatform.fp8_dtype() == torch.float8_e4m3fnuz
    monkeypatch.setenv(HIP_VAR, "0")
    monkeypatch.setenv(CUDA_VAR, "0")
    assert RocmPlatform.fp8_dtype() is None  # gfx90a: no fp8


def test_architecture_unknown_to_amdsmi_comes_from_torch_properties(monkeypatch, rocm_torch):
    """A GPU listed by UUID has no architecture from the listing: torch's device properties
    (faked: there is no GPU here) are asked, as they would be on the device."""
    with_amdsmi(monkeypatch, fake_amdsmi(["gfx950"]))
    monkeypatch.setenv(ROCR_VAR, "GPU-52a4b1c0d9e8f7a6")
    props = types.SimpleNamespace(gcnArchName="gfx950:sramecc+:xnack-")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    assert RocmPlatform.gfx_arch(0).name == "gfx950"
    assert RocmPlatform.fp8_dtype() == torch.float8_e4m3fn


def test_device_without_a_visible_gpu_is_a_clear_error(monkeypatch, rocm_torch, no_sysfs):
    with_amdsmi(monkeypatch, None)
    with pytest.raises(RocmVisibleDevicesError, match="no AMD GPU is visible"):
        RocmPlatform.device(0)


def test_runtime_declarations():
    assert (RocmPlatform.name, RocmPlatform.device_type) == ("rocm", "cuda")
    assert RocmPlatform.dist_backend == "nccl"  # RCCL
    assert RocmPlatform.needs_warm_up and RocmPlatform.is_pin_memory_available()
    assert RocmPlatform.async_scheduling_default is False  # not measured on AMD
    assert RocmPlatform.attention_backend_ranking()[0] == "TRITON_ATTN"


# ---------------------------------------------------------------------- the shipped fake


def test_the_shipped_fake_makes_rocm_active_and_leaves_no_trace(monkeypatch):
    """`pagellm_rocm.fake_hardware` (the conformance kit's faked ROCm run): inside, the hooks
    answer as on one MI300X; outside, as on this machine, with amdsmi as it was."""
    from pagellm_rocm.fake_hardware import fake_rocm, gfx942

    monkeypatch.delitem(sys.modules, "amdsmi", raising=False)
    before = (torch.version.hip, torch.version.cuda)
    with gfx942() as description:
        assert "1 gfx942 GPU(s) listed by a stand-in amdsmi" in description
        assert rocm_plugin.pagellm_platform() == ROCM_CLASS
        assert cuda_plugin.pagellm_platform() is None
        assert RocmPlatform.fp8_dtype() == torch.float8_e4m3fnuz
        assert RocmPlatform.device_count() == 1
    assert (torch.version.hip, torch.version.cuda) == before and "amdsmi" not in sys.modules
    assert rocm_plugin.pagellm_platform() is None
    with pytest.raises(UnknownArchitectureError, match="gfx9999"):
        fake_rocm("gfx9999").__enter__()


# ---------------------------------------------------------------------- the real CLI


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {
        k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "PAGELLM_PLATFORM")
    }
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_pagellm_plugins_shows_rocm_inactive_with_the_reason():
    proc = run_python(
        "from pagellm.entrypoints.cli import main; raise SystemExit(main(['plugins', '--json']))"
    )
    assert proc.returncode == 0, proc.stderr
    records = {r["name"]: r for r in json.loads(proc.stdout)["pagellm.platform_plugins"]}
    rocm = records["rocm"]
    assert (rocm["distribution"], rocm["status"], rocm["api_version"]) == (
        "pagellm-rocm",
        "loaded",
        "1.3",
    )
    assert rocm["reason"] == "inactive: torch is not a ROCm build (torch.version.hip is None)"
    assert records["cuda"]["reason"].startswith("inactive: torch is not a CUDA build")


FAKE_ROCM_PROCESS = """
import json, sys, types
import torch

# A ROCm build of torch with two MI300X, as far as this process can tell (no AMD GPU exists
# where the tests run): torch's version fields and an amdsmi module that lists two gfx942.
torch.version.hip, torch.version.cuda = "6.4.43482", None
torch.cuda.device_count = lambda: 2
amdsmi = types.ModuleType("amdsmi")
amdsmi.amdsmi_init = amdsmi.amdsmi_shut_down = lambda: None
amdsmi.amdsmi_get_processor_handles = lambda: [0, 1]
amdsmi.amdsmi_get_gpu_asic_info = lambda h: {"target_graphics_version": "gfx942"}
sys.modules["amdsmi"] = amdsmi

from pagellm.platforms import current_platform, current_platform_name
from pagellm.plugins.report import plugin_report

records = {r["name"]: r for r in plugin_report()["pagellm.platform_plugins"]}
print(json.dumps({
    "platform": current_platform_name(),
    "count": current_platform.device_count(),
    "cuda": records["cuda"]["reason"],
    "rocm": records["rocm"]["reason"],
}))
"""


def test_a_rocm_process_picks_rocm_and_the_cuda_plugin_says_why_not():
    proc = run_python(FAKE_ROCM_PROCESS, HIP_VISIBLE_DEVICES="1")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["platform"], out["count"], out["rocm"]) == ("rocm", 1, None)
    assert out["cuda"].startswith("inactive: torch is a ROCm build (torch.version.hip 6.4")
