"""`benchmarks/dev_install.py`, the GPU machine's stand-in for ``pip install -e`` of every package:
in a Python that sees nothing but the directory it writes (``python -S``), every package's
modules are found in the source tree and its entry points and version are what pip would give."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]
PACKAGES = sorted(
    str(p.parent.relative_to(REPO))
    for p in [
        REPO / "pyproject.toml",
        *REPO.glob("plugins/*/*/pyproject.toml"),
        *REPO.glob("plugins/*/pyproject.toml"),
    ]
)

PROBE = """
import importlib.metadata as md, importlib.util, json, site, sys
site.addsitedir(sys.argv[1])
eps = md.entry_points()
print(json.dumps({
    "entry_points": sorted([g, e.name, e.value, e.dist.name] for g in eps.groups for e in eps.select(group=g)),
    "versions": {d.metadata["Name"]: d.version for d in md.distributions()},
    "origins": {m: importlib.util.find_spec(m).origin for m in sys.argv[2:]},
}))
"""


def test_dev_install_gives_each_package_its_modules_entry_points_and_launcher(tmp_path: Path):
    site, bin_dir = tmp_path / "site", tmp_path / "bin"
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks/dev_install.py"), "--site", str(site),
         "--bin", str(bin_dir), *PACKAGES],
        cwd=REPO, check=True, capture_output=True, text=True,
    )  # fmt: skip
    expected_eps, versions, modules = [], {}, {}
    for package in PACKAGES:
        data = tomllib.loads((REPO / package / "pyproject.toml").read_text())
        project = data["project"]
        versions[project["name"]] = project["version"]
        groups = {**project.get("entry-points", {}), "console_scripts": project.get("scripts", {})}
        for group, entries in groups.items():
            expected_eps += [
                [group, name, value, project["name"]] for name, value in entries.items()
            ]
        (include,) = data["tool"]["setuptools"]["packages"]["find"]["include"]
        modules[include.rstrip("*")] = package

    probe = subprocess.run(
        [sys.executable, "-S", "-c", PROBE, str(site), *modules],
        cwd=tmp_path, check=True, capture_output=True, text=True,
    )  # fmt: skip
    found = json.loads(probe.stdout)

    assert found["entry_points"] == sorted(expected_eps)
    assert found["versions"] == versions
    for module, package in modules.items():  # imported from the tree, not a copy
        assert Path(found["origins"][module]).is_relative_to(REPO / package), module
    launcher = (bin_dir / "pagellm").read_text()
    assert launcher.startswith(f"#!{sys.executable}\n")
    assert "from pagellm.entrypoints.cli import main" in launcher
