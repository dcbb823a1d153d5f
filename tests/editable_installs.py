"""``pip install -e`` of plugin packages from this checkout, for the tests that need them really
installed (entry points are read from installed distributions only)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import tomllib


@contextlib.contextmanager
def editable_installs(projects: list[Path]) -> Iterator[None]:
    """``pip install -e`` each project from this checkout (replacing any install of the same
    name), check that a fresh interpreter imports its packages, and uninstall them afterwards."""
    pip = [sys.executable, "-m", "pip", "-q"]
    if not projects:
        yield
        return
    metadata = [tomllib.loads((p / "pyproject.toml").read_text()) for p in projects]
    args = [a for p in projects for a in ("-e", str(p))]
    subprocess.run([*pip, "install", "--no-deps", "--no-build-isolation", *args], check=True)
    try:
        packages = [
            pkg
            for m in metadata
            for pkg in m.get("tool", {}).get("setuptools", {}).get("packages")
            or [m["project"]["name"].replace("-", "_")]
        ]
        check = subprocess.run(
            [sys.executable, "-c", "".join(f"import {pkg}\n" for pkg in packages)],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent.parent,
        )
        assert check.returncode == 0, f"installed, yet not importable:\n{check.stderr}"
        yield
    finally:
        subprocess.run([*pip, "uninstall", "-y", *(m["project"]["name"] for m in metadata)])
