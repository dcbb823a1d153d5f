"""Install the project's packages for development in about a second: what ``pip install -e`` of
each gives the GPU machine (its modules importable from the source tree, its entry points and its
``pagellm`` command), without building an editable wheel per package (about 20 s for the 13
packages, paid again on every freshly started machine).

For each package directory it writes into ``--site`` (by default the interpreter's own
site-packages, whose ``.pth`` files Python reads at start-up):

- ``<name>-<version>.dist-info/`` with ``METADATA`` (name, version) and ``entry_points.txt``,
  from the package's ``pyproject.toml``, which is what `importlib.metadata` and the plugin
  loader read;
- one line in ``pagellm-dev.pth``: the directory its modules live in (``[tool.setuptools.
  packages.find] where``, else the package directory);

and a launcher in ``--bin`` (by default where pip puts scripts) for each ``[project.scripts]``.
Only static ``[project]`` fields are read (the project's packages have no dynamic ones; a
package with any is refused, so pip is used for it instead). Uses the standard library only.

    python3 benchmarks/dev_install.py . plugins/cuda_platform plugins/quantization/fp8 ...
"""

from __future__ import annotations

import argparse
import re
import sys
import sysconfig
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

PTH = "pagellm-dev.pth"


def normalized(name: str) -> str:
    """A distribution's name as dist-info directories spell it."""
    return re.sub(r"[-_.]+", "_", name).lower()


def read_project(directory: Path) -> dict:
    data = tomllib.loads((directory / "pyproject.toml").read_text(encoding="utf-8"))
    project = data.get("project")
    if not project or "name" not in project or "version" not in project:
        raise SystemExit(f"{directory}/pyproject.toml has no static [project] name and version")
    if project.get("dynamic"):
        raise SystemExit(f"{directory}: dynamic fields {project['dynamic']}: use pip install -e")
    where = data.get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {})
    roots = where.get("where", ["."])
    if len(roots) != 1:
        raise SystemExit(f"{directory}: several package roots {roots}: use pip install -e")
    return {**project, "root": (directory / roots[0]).resolve()}


def entry_points_text(project: dict) -> str:
    groups = dict(project.get("entry-points", {}))
    if project.get("scripts"):
        groups["console_scripts"] = project["scripts"]
    lines = []
    for group, entries in groups.items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {value}" for name, value in entries.items()]
        lines.append("")
    return "\n".join(lines)


def install(directory: Path, site: Path, bin_dir: Path) -> Path:
    """Write ``directory``'s dist-info and launchers; returns the root its modules live in."""
    project = read_project(directory)
    name, version = project["name"], project["version"]
    for old in site.glob(f"{normalized(name)}-*.dist-info"):  # an earlier version's
        for file in old.iterdir():
            file.unlink()
        old.rmdir()
    info = site / f"{normalized(name)}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(entry_points_text(project))
    (info / "INSTALLER").write_text("dev_install\n")
    for script, target in project.get("scripts", {}).items():
        module, _, function = target.partition(":")
        launcher = bin_dir / script
        launcher.write_text(
            f"#!{sys.executable}\nimport sys\nfrom {module} import {function}\n"
            f"sys.exit({function}())\n"
        )
        launcher.chmod(0o755)
    return project["root"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packages", nargs="+", type=Path, help="directories with a pyproject.toml")
    parser.add_argument("--site", type=Path, default=Path(sysconfig.get_paths()["purelib"]))
    parser.add_argument("--bin", type=Path, default=Path(sysconfig.get_paths()["scripts"]))
    args = parser.parse_args()
    args.site.mkdir(parents=True, exist_ok=True)
    args.bin.mkdir(parents=True, exist_ok=True)
    roots = [install(directory, args.site, args.bin) for directory in args.packages]
    (args.site / PTH).write_text("".join(f"{root}\n" for root in dict.fromkeys(roots)))
    print(f"dev_install: {len(roots)} packages into {args.site} ({PTH})")


if __name__ == "__main__":
    main()
