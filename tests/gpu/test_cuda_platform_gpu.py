"""The CUDA platform plugin on a real GPU: detection (without poisoning fork), device facts,
``CUDA_VISIBLE_DEVICES`` on the real device, and KV-cache sizing by profiling.

Run on the GPU machine with ``pytest -m gpu tests/gpu``; skipped without CUDA. Checks that depend
on which platform a process picks run in fresh processes, where the plugin is installed before
pagellm first reads ``current_platform``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagellm.engine.args import EngineArgs

PLUGIN_DIR = Path(__file__).resolve().parents[2] / "plugins" / "cuda_platform"
if importlib.util.find_spec("pagellm_cuda") is None:
    # Installed by the fixture below for the subprocesses; this process started before that, and
    # an editable install's import hook is only read at start-up, so import from the source.
    sys.path.insert(0, str(PLUGIN_DIR))

from pagellm_cuda.devices import cuda_device_count  # noqa: E402
from pagellm_cuda.platform import CudaPlatform  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GiB = 2**30


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


def test_cuda_platform_is_current(installed):
    proc = run_python(
        """
        from pagellm.platforms import current_platform, current_platform_name
        print(current_platform_name(), current_platform.device_type, current_platform.needs_warm_up)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["cuda", "cuda", "True"]


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


def test_kv_cache_sizing_by_profiling_a_tiny_model(installed, tiny_models):
    proc = run_python(TINY_MODEL_SIZING, tiny_models["llama3"])
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["platform"] == "cuda"
    bf16 = torch.cuda.get_device_capability(0) >= (8, 0)
    assert out["dtype"] == ("bfloat16" if bf16 else "float16")  # the tiny model is float32
    assert 0 < out["available"] < out["utilization"] * out["total"] - out["weights"]


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


def test_visible_devices_index_maps_to_the_physical_device(installed):
    last = torch.cuda.device_count() - 1
    out = probe_visible_devices(str(last))
    assert (out["count"], out["physical"], out["device"]) == (1, last, "cuda:0")
    assert out["name"] == torch.cuda.get_device_name(last)
    assert "CUDA device 1 does not exist" in out["error"]


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
