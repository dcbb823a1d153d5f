"""The CUDA platform's Triton kernels compiled for real GPU targets without a GPU (Triton lowers
them and its bundled ptxas assembles them), in a child process outside Triton's interpreter:
what the interpreter cannot check."""

from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_norm_and_silu_let_the_next_kernel_start_early_on_sm90_only() -> None:
    """Compiled for sm_90 (sm90_launch_dependents.py, in a child process outside the
    interpreter), RMSNorm and SiLU-and-mul, the kernels before pagellm-int4's GEMMs, execute
    ``griddepcontrol.launch_dependents`` (so a GEMM launched with programmatic dependent launch
    may start while they run); compiled for sm_80, which lacks it, they do not."""
    from pagellm_cuda.ops.target import gdc_launch_dependents
    from triton.compiler import ASTSource

    if gdc_launch_dependents is None:
        pytest.skip("this Triton has no griddepcontrol (3.3 and later)")
    if "constexprs" not in inspect.signature(ASTSource).parameters:
        pytest.skip("this Triton's ASTSource takes another signature (written for Triton 3.6)")
    child = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("sm90_launch_dependents.py"))],
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, f"{child.stdout}\n{child.stderr}"
    assert child.stdout.split("\n")[:4] == [
        "sm_90 rms_norm launch_dependents=True",
        "sm_90 silu_and_mul launch_dependents=True",
        "sm_80 rms_norm launch_dependents=False",
        "sm_80 silu_and_mul launch_dependents=False",
    ], child.stdout
