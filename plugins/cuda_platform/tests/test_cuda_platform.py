"""The CUDA platform plugin (`plugins/cuda_platform`), on a machine without a GPU and on one with.

What runs for real without a GPU: the installed plugin's discovery and its inactive answer, the
device-id mapping, dtype choice, CUDA-graph sizes, the memory arithmetic and
`check_and_update_config` on a real engine config. The tests marked ``gpu`` (``pytest -m gpu`` on
the GPU machine; skipped without CUDA) check detection without poisoning fork, device facts,
``CUDA_VISIBLE_DEVICES`` on the real device, and KV-cache sizing by profiling. Checks that depend
on which platform a process picks run in fresh processes, where the plugin is installed before
pagellm first reads ``current_platform``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagellm.attention.backends.torch_sdpa import TorchSDPABackend
from pagellm.attention.selector import select_attention_backend
from pagellm.config import EngineConfig
from pagellm.engine.args import EngineArgs
from pagellm.layers.custom_ops import OP_NAMES

PLUGIN_DIR = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("pagellm_cuda") is None:
    # Installed by the fixture below for the subprocesses; this process started before that, and
    # an editable install's import hook is only read at start-up, so import from the source.
    sys.path.insert(0, str(PLUGIN_DIR))

from pagellm_cuda import platform as cuda_platform  # noqa: E402
from pagellm_cuda.cudagraphs import cudagraph_capture_sizes  # noqa: E402
from pagellm_cuda.devices import (  # noqa: E402
    CudaDeviceError,
    cuda_device_count,
    parse_visible_devices,
    physical_device_id,
    visible_device_id,
    visible_device_ids,
)
from pagellm_cuda.memory import (  # noqa: E402
    CUDAGRAPH_OVERHEAD_PER_GRAPH,
    InsufficientMemoryError,
    MemoryProfile,
    cudagraph_reserve,
    kv_cache_bytes,
)
from pagellm_cuda.platform import CudaPlatform, auto_dtype  # noqa: E402
from pagellm_cuda.plugin import pagellm_platform  # noqa: E402

GiB = 2**30
VAR = "CUDA_VISIBLE_DEVICES"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def installed() -> Iterator[None]:
    """``pip install -e`` the plugin unless it already is; uninstall only what was installed here."""
    try:
        importlib.metadata.distribution("pagellm-cuda")
        yield
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-build-isolation", "-e", str(PLUGIN_DIR)], check=True
    )
    yield
    subprocess.run([*pip, "uninstall", "-y", "pagellm-cuda"], check=True)


def run_python(code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {
        k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "PAGELLM_PLATFORM")
    }
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )


# ---------------------------------------------------------------------- discovery


def test_plugin_is_discovered_and_reports_itself_inactive_without_a_gpu(installed):
    proc = run_python(
        "from pagellm.entrypoints.cli import main; raise SystemExit(main(['plugins', '--json']))"
    )
    assert proc.returncode == 0, proc.stderr
    records = {r["name"]: r for r in json.loads(proc.stdout)["pagellm.platform_plugins"]}
    cuda = records["cuda"]
    assert (cuda["distribution"], cuda["status"]) == ("pagellm-cuda", "loaded")
    assert cuda["reason"] == "inactive: torch is not a CUDA build (torch.version.cuda is None)"


def test_current_platform_with_the_plugin_installed_is_the_machines(installed, device):
    """The CUDA platform where a GPU is, warmed up at start-up (its Triton kernels compile on
    first use); the CPU platform stays current on a machine without one."""
    proc = run_python(
        """
        from pagellm.platforms import current_platform, current_platform_name
        print(current_platform_name(), current_platform.device_type, current_platform.needs_warm_up)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [device, device, str(device == "cuda")]


def test_hook_answers_none_on_a_cpu_build_of_torch():
    assert torch.version.cuda is None  # this machine's torch: the case under test
    assert cuda_device_count() == 0
    assert pagellm_platform() is None


def test_cpu_build_says_why_it_is_inactive():
    from pagellm_cuda.plugin import pagellm_platform_inactive_reason

    assert pagellm_platform_inactive_reason() == (
        "torch is not a CUDA build (torch.version.cuda is None)"
    )


@pytest.mark.parametrize("cuda_version", [None, "12.8"])
def test_rocm_build_is_left_to_the_rocm_platform(monkeypatch, cuda_version):
    """A ROCm build of torch (faked: none is installed here) answers through torch.cuda and may
    count AMD GPUs there; the CUDA platform still counts none and names the rocm platform."""
    from pagellm_cuda.devices import inactive_reason
    from pagellm_cuda.plugin import pagellm_platform_inactive_reason

    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    monkeypatch.setattr(torch.version, "cuda", cuda_version)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert cuda_device_count() == 0
    assert pagellm_platform() is None
    reason = pagellm_platform_inactive_reason()
    assert reason == inactive_reason({})
    assert reason.startswith("torch is a ROCm build (torch.version.hip 6.4.43482)")
    assert "rocm platform" in reason


def test_cuda_build_without_a_visible_gpu_names_the_variable(monkeypatch):
    """A CUDA build of torch (faked) that counts no GPU."""
    from pagellm_cuda.devices import inactive_reason

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert inactive_reason({VAR: "-1"}) == "no CUDA device is visible (CUDA_VISIBLE_DEVICES '-1')"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert inactive_reason({}) is None


def test_device_without_a_visible_gpu_is_a_clear_error():
    with pytest.raises(CudaDeviceError, match="no CUDA device is visible"):
        CudaPlatform.device(0)


@pytest.mark.gpu
@needs_cuda
def test_detection_does_not_poison_fork(installed):
    """The hook runs in every process before workers are forked: a forked child must still be
    able to use CUDA afterwards."""
    proc = run_python(
        """
        import multiprocessing
        import torch
        from pagellm_cuda.plugin import pagellm_platform

        assert pagellm_platform() == "pagellm_cuda.platform:CudaPlatform"
        assert not torch.cuda.is_initialized()

        def child():
            assert torch.ones(4, device="cuda").sum().item() == 4

        p = multiprocessing.get_context("fork").Process(target=child)
        p.start()
        p.join()
        raise SystemExit(p.exitcode)
        """
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.gpu
@needs_cuda
def test_device_facts_are_sane():
    assert cuda_device_count() == torch.cuda.device_count() >= 1
    name = CudaPlatform.device_name(0)
    assert isinstance(name, str) and name == torch.cuda.get_device_name(0)
    major, minor = CudaPlatform.device_capability(0)
    assert (major, minor) == torch.cuda.get_device_capability(0) and major >= 7
    total = CudaPlatform.total_memory(0)
    _, driver_total = torch.cuda.mem_get_info(0)
    assert GiB < total and abs(total - driver_total) < 0.05 * driver_total
    assert CudaPlatform.device(0) == torch.device("cuda", 0)
    assert torch.cuda.current_device() == 0
    expected = torch.bfloat16 if (major, minor) >= (8, 0) else torch.float16
    assert CudaPlatform.default_dtype(torch.float32) == expected
    assert CudaPlatform.default_dtype(torch.float16) == torch.float16


# ---------------------------------------------------------------------- device ids


@pytest.mark.parametrize("env", [{}, {VAR: ""}, {VAR: "  "}], ids=["unset", "empty", "blank"])
def test_unset_or_empty_visible_devices_means_every_device(env):
    assert parse_visible_devices(env.get(VAR)) is None
    assert visible_device_ids(env, 4) == [0, 1, 2, 3]
    assert [physical_device_id(i, env, 4) for i in range(4)] == [0, 1, 2, 3]


def test_visible_devices_list_maps_logical_to_physical():
    env = {VAR: "6, 4,5"}
    assert visible_device_ids(env, 3) == [6, 4, 5]
    assert [visible_device_id(i, env, 3) for i in range(3)] == [0, 1, 2]
    assert [physical_device_id(i, env, 3) for i in range(3)] == [6, 4, 5]


def test_uuids_are_passed_through_as_strings():
    env = {VAR: "GPU-5f1c2b7e-aaaa-bbbb-cccc-0123456789ab, MIG-0c2d-11,3"}
    assert visible_device_ids(env, 3) == [
        "GPU-5f1c2b7e-aaaa-bbbb-cccc-0123456789ab",
        "MIG-0c2d-11",
        3,
    ]
    assert physical_device_id(1, env, 3) == "MIG-0c2d-11"


def test_negative_id_ends_the_list_as_in_cuda():
    assert parse_visible_devices("2,-1,3") == [2]
    assert parse_visible_devices("-1") == []


def test_ids_cuda_does_not_expose_are_cut_off():
    # CUDA_VISIBLE_DEVICES=0,1,7 on a 4-GPU machine: CUDA stops at 7 and exposes 2 devices.
    assert visible_device_ids({VAR: "0,1,7"}, 2) == [0, 1]


@pytest.mark.parametrize(
    ("logical", "env", "num_devices", "message"),
    [
        (2, {VAR: "4,5"}, 2, r"CUDA device 2 does not exist: 2 CUDA device\(s\) are visible"),
        (4, {}, 4, r"physical ids \[0, 1, 2, 3\]\) \(CUDA_VISIBLE_DEVICES unset\)"),
        (-1, {VAR: "0"}, 1, "from 0 to 0"),
        (0, {VAR: "-1"}, 0, "no CUDA device is visible"),
    ],
    ids=["past-list", "past-all", "negative", "none-visible"],
)
def test_out_of_range_logical_id_is_a_clear_error(logical, env, num_devices, message):
    with pytest.raises(CudaDeviceError, match=message):
        physical_device_id(logical, env, num_devices)


VISIBLE_DEVICES_PROBE = """
import json
from pagellm_cuda.devices import CudaDeviceError, cuda_device_count
from pagellm_cuda.platform import CudaPlatform

try:
    CudaPlatform.device(1)
    error = None
except CudaDeviceError as exc:
    error = str(exc)
print(json.dumps({
    "count": cuda_device_count(),
    "physical": CudaPlatform.physical_device_id(0),
    "device": str(CudaPlatform.device(0)),
    "name": CudaPlatform.device_name(0),
    "error": error,
}))
"""


def probe_visible_devices(value: str) -> dict:
    proc = run_python(VISIBLE_DEVICES_PROBE, CUDA_VISIBLE_DEVICES=value)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
@needs_cuda
def test_visible_devices_index_maps_to_the_physical_device(installed):
    last = torch.cuda.device_count() - 1
    out = probe_visible_devices(str(last))
    assert (out["count"], out["physical"], out["device"]) == (1, last, "cuda:0")
    assert out["name"] == torch.cuda.get_device_name(last)
    assert "CUDA device 1 does not exist" in out["error"]


@pytest.mark.gpu
@needs_cuda
def test_visible_devices_uuid_is_passed_through(installed):
    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi is needed to read the GPU's UUID")
    last = torch.cuda.device_count() - 1
    uuid = subprocess.run(
        ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader", "-i", str(last)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    out = probe_visible_devices(uuid)
    assert (out["count"], out["physical"], out["device"]) == (1, uuid, "cuda:0")
    assert out["name"] == torch.cuda.get_device_name(last)


# ---------------------------------------------------------------------- dtype, attention


@pytest.mark.parametrize(
    ("checkpoint", "capability", "expected"),
    [
        (torch.float16, (9, 0), torch.float16),
        (torch.bfloat16, (9, 0), torch.bfloat16),
        (torch.float32, (9, 0), torch.bfloat16),
        (None, (8, 0), torch.bfloat16),
        (torch.float16, (7, 5), torch.float16),
        (torch.bfloat16, (7, 5), torch.float16),
        (torch.float32, (7, 0), torch.float16),
    ],
)
def test_auto_dtype_prefers_bfloat16_where_the_gpu_has_it(checkpoint, capability, expected):
    assert auto_dtype(checkpoint, capability) == expected


def test_explicit_float32_is_allowed():
    assert set(CudaPlatform.supported_dtypes) == {torch.bfloat16, torch.float16, torch.float32}


def test_attention_ranking_and_selection_among_installed_backends():
    ranking = CudaPlatform.attention_backend_ranking()
    assert ranking == ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "TORCH_SDPA"]
    chosen = select_attention_backend(
        requested=None,
        ranking=ranking,
        device_type=CudaPlatform.device_type,
        head_size=64,
        dtype=torch.bfloat16,
        block_size=None,
        sliding_window=None,
    )
    assert chosen.name in ranking


def test_runtime_declarations():
    assert (CudaPlatform.name, CudaPlatform.device_type) == ("cuda", "cuda")
    assert CudaPlatform.is_pin_memory_available()
    assert CudaPlatform.needs_warm_up  # Triton kernels compile on first use


# ---------------------------------------------------------------------- CUDA graphs


def test_capture_sizes_ladder():
    eights = list(range(16, 257, 8))
    sixteens = list(range(272, 513, 16))
    assert cudagraph_capture_sizes(512) == [1, 2, 4, 8, *eights, *sixteens]
    assert cudagraph_capture_sizes(256) == [1, 2, 4, 8, *eights]
    assert cudagraph_capture_sizes(100) == [1, 2, 4, 8, *range(16, 97, 8), 100]
    assert cudagraph_capture_sizes(300) == [1, 2, 4, 8, *eights, 272, 288, 300]
    assert cudagraph_capture_sizes(3) == [1, 2, 3]
    assert cudagraph_capture_sizes(1) == [1]
    assert cudagraph_capture_sizes(1000) == cudagraph_capture_sizes(512)


class CudaGraphCapableBackend(TorchSDPABackend):
    """Stands in for a GPU backend with CUDA-graph support (none is installed on this machine)."""

    name = "CUDAGRAPH_TEST"
    supported_device_types = ("cuda",)
    cudagraph_support = True


@pytest.fixture
def capable_backend(monkeypatch: pytest.MonkeyPatch) -> str:
    from pagellm.attention.registry import attention_backends

    # Registered for this test only, so no later selection sees it.
    entry = (f"{__name__}:CudaGraphCapableBackend", None)
    monkeypatch.setitem(attention_backends._entries, CudaGraphCapableBackend.name, entry)
    return CudaGraphCapableBackend.name


def engine_config(model: str, **kwargs) -> EngineConfig:
    return EngineArgs(
        model=model, max_model_len=64, kv_cache_memory=4 << 20, **kwargs
    ).create_engine_config()


def test_cudagraphs_on_for_a_capable_backend(tiny_models, capable_backend):
    config = engine_config(tiny_models["llama3"], max_num_seqs=48)
    config.attention_backend = capable_backend
    CudaPlatform.check_and_update_config(config)
    assert config.compilation.cudagraph_mode == "decode"
    assert config.compilation.cudagraph_capture_sizes == [1, 2, 4, 8, 16, 24, 32, 40, 48]


def test_enforce_eager_turns_cudagraphs_off(tiny_models, capable_backend, caplog):
    config = engine_config(tiny_models["llama3"], enforce_eager=True)
    config.attention_backend = capable_backend
    config.compilation.cudagraph_mode = "decode"
    with caplog.at_level(logging.INFO, logger=cuda_platform.__name__):
        CudaPlatform.check_and_update_config(config)
    assert config.compilation.cudagraph_mode == "none"
    assert config.compilation.cudagraph_capture_sizes == []
    assert "--enforce-eager" in caplog.text


def test_backend_without_cudagraph_support_turns_cudagraphs_off(tiny_models, caplog):
    config = engine_config(tiny_models["llama3"])
    assert config.attention_backend == "TORCH_SDPA"
    config.compilation.cudagraph_mode = "decode"
    config.compilation.cudagraph_capture_sizes = [1, 2]
    with caplog.at_level(logging.INFO, logger=cuda_platform.__name__):
        CudaPlatform.check_and_update_config(config)
    assert config.compilation.cudagraph_mode == "none"
    assert config.compilation.cudagraph_capture_sizes == []
    assert "TORCH_SDPA does not support them" in caplog.text


# ---------------------------------------------------------------------- KV cache memory


def profile(**overrides: int) -> MemoryProfile:
    numbers = dict(
        total=80 * GiB, weights=16 * GiB, baseline=17 * GiB, peak=21 * GiB, non_torch=GiB
    )
    return MemoryProfile(**{**numbers, **overrides})


def test_kv_cache_gets_the_budget_minus_the_peak():
    p = profile(cudagraphs=GiB // 2)
    assert p.activations == 4 * GiB
    assert p.peak_used == 21 * GiB + GiB + GiB // 2
    assert kv_cache_bytes(p, 0.9) == int(0.9 * 80 * GiB) - p.peak_used


def test_no_room_for_the_kv_cache_explains_the_numbers_and_the_fixes():
    with pytest.raises(InsufficientMemoryError) as err:
        kv_cache_bytes(profile(cudagraphs=GiB), 0.25)
    message = str(err.value)
    for text in (
        "gpu_memory_utilization 0.25 of 80.00 GiB allows 20.00 GiB",
        "already takes 23.00 GiB",
        "weights 16.00 GiB",
        "other tensors 1.00 GiB",
        "peak activations 4.00 GiB",
        "1.00 GiB outside PyTorch",
        "1.00 GiB set aside for CUDA graphs",
        "--gpu-memory-utilization",
        "--max-num-batched-tokens",
        "--max-model-len",
        "--enforce-eager",
    ):
        assert text in message
    with pytest.raises(InsufficientMemoryError):  # exactly nothing left is no KV cache either
        kv_cache_bytes(profile(total=100 * GiB, peak=20 * GiB, non_torch=0), 0.2)


def test_cudagraph_reserve_scales_activations_to_the_largest_graph():
    assert cudagraph_reserve(8 * GiB, 512, 8192, 35) == GiB // 2 + 35 * CUDAGRAPH_OVERHEAD_PER_GRAPH
    assert cudagraph_reserve(GiB, 512, 256, 1) == GiB + CUDAGRAPH_OVERHEAD_PER_GRAPH
    assert cudagraph_reserve(GiB, 512, 8192, 0) == 0


def test_explicit_kv_cache_memory_skips_profiling(tiny_models):
    config = engine_config(tiny_models["llama3"])

    def profile_run() -> None:
        raise AssertionError("profiling must not run when kv_cache_memory is set")

    assert CudaPlatform.available_kv_cache_memory(config, 1 << 20, profile_run) == 4 << 20


@pytest.mark.gpu
@needs_cuda
def test_profiling_measures_the_activation_peak(tiny_models):
    """A profiling run that peaks 1 GiB higher leaves the KV cache 1 GiB less."""
    config = EngineArgs(
        model=tiny_models["llama3"], max_model_len=64, enforce_eager=True
    ).create_engine_config()
    config.cache.gpu_memory_utilization = 0.5
    CudaPlatform.check_and_update_config(config)
    CudaPlatform.device(0)

    def one_gib_peak() -> None:
        torch.empty(GiB, dtype=torch.uint8, device="cuda").fill_(1)

    idle = CudaPlatform.available_kv_cache_memory(config, 0, lambda: None)
    busy = CudaPlatform.available_kv_cache_memory(config, 0, one_gib_peak)
    total = CudaPlatform.total_memory(0)
    assert 0 < busy < idle < 0.5 * total
    # Driver-side memory (cuBLAS workspaces) moves a little between the two runs.
    assert abs((idle - busy) - GiB) < 160 << 20


TINY_MODEL_SIZING = """
import json, sys
import torch
from pagellm.engine.args import EngineArgs
from pagellm.platforms import current_platform_name
from pagellm.worker.worker import Worker

config = EngineArgs(
    model=sys.argv[1], max_model_len=256, max_num_batched_tokens=512
).create_engine_config()
worker = Worker(config)
worker.load_model()
available = worker.determine_available_memory()
print(json.dumps({
    "platform": current_platform_name(),
    "dtype": config.model.dtype,
    "utilization": config.cache.gpu_memory_utilization,
    "available": available,
    "total": torch.cuda.mem_get_info()[1],
    "weights": worker.model_memory_bytes(),
}))
"""


@pytest.mark.gpu
@needs_cuda
def test_kv_cache_sizing_by_profiling_a_tiny_model(installed, tiny_models):
    proc = run_python(TINY_MODEL_SIZING, tiny_models["llama3"])
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["platform"] == "cuda"
    bf16 = torch.cuda.get_device_capability(0) >= (8, 0)
    assert out["dtype"] == ("bfloat16" if bf16 else "float16")  # the tiny model is float32
    assert 0 < out["available"] < out["utilization"] * out["total"] - out["weights"]


# ---------------------------------------------------------------------- custom ops


def test_custom_ops_can_be_disabled_for_ab_comparisons(monkeypatch):
    monkeypatch.setenv("PAGELLM_DISABLE_CUSTOM_OPS", "1")
    assert CudaPlatform.custom_ops() == {}


def test_custom_ops_name_known_ops(monkeypatch):
    monkeypatch.delenv("PAGELLM_DISABLE_CUSTOM_OPS", raising=False)
    assert set(CudaPlatform.custom_ops()) <= set(OP_NAMES)


def test_custom_ops_that_cannot_import_fall_back_with_a_warning(monkeypatch, caplog):
    """A missing Triton cannot be produced here (it is installed), so the import is made to fail."""
    monkeypatch.delenv("PAGELLM_DISABLE_CUSTOM_OPS", raising=False)
    monkeypatch.setitem(sys.modules, "pagellm_cuda.ops", None)
    cuda_platform._load_custom_ops.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cuda_platform.__name__):
            assert CudaPlatform.custom_ops() == {}
    finally:
        cuda_platform._load_custom_ops.cache_clear()
    assert "CUDA custom ops unavailable" in caplog.text


@pytest.mark.gpu
@needs_cuda
def test_step_results_come_back_through_pinned_memory_once_the_device_is_done():
    """`copy_to_host` returns at once, while the device is still busy; `wait` blocks on the
    side stream's event and hands back the values in pinned memory (asynchronous scheduling)."""
    values = torch.arange(4096, device="cuda")
    torch.cuda._sleep(100_000_000)  # the step still running when its results are asked for
    tripled = values * 3
    copy = CudaPlatform.copy_to_host([tripled, tripled[:5].float()])
    host = copy.wait()
    assert all(t.is_pinned() and t.device.type == "cpu" for t in host)
    assert host[0].tolist() == list(range(0, 3 * 4096, 3))
    assert host[1].tolist() == [0.0, 3.0, 6.0, 9.0, 12.0]
    assert copy.wait() is host
