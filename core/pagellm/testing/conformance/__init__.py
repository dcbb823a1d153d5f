"""The conformance kit: a pytest plugin that runs a battery of cases against an installed platform
and attention backends.

    pytest --pagellm-platform NAME [--pagellm-backend NAME ...] [--pagellm-fake-hardware MODULE:NAME]

pytest loads it by itself (the core's ``pytest11`` entry point), or with
``-p pagellm.testing.conformance``. Without either option it only adds them: nothing is collected
or changed, so a project's own test run is unaffected. With one, the run collects the kit's cases
(the ``test_*.py`` modules of this package) instead of the project's tests; their fixtures are in
this package's ``conftest.py``, which pytest loads only then. docs/plugins.md ("Conformance kit")
says what each case checks.

``--pagellm-fake-hardware`` checks a platform where its hardware is absent: the plugin's faked
hardware facts (`faked_hardware`) are in place before anything asks the platform plugins, so the
platform resolves active and every case that needs no device runs against it; the cases that
would run on its device skip, saying the hardware is faked.
"""

from __future__ import annotations

from fnmatch import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pagellm.testing.conformance.targets import Targets

KIT_DIR = Path(__file__).parent
CASES = sorted(KIT_DIR.glob("test_*.py"))
TARGETS: pytest.StashKey[Targets] = pytest.StashKey()
"""Where `pytest_configure` keeps the resolved `targets.Targets` for the cases' fixtures."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pagellm", "pagellm conformance kit")
    group.addoption(
        "--pagellm-platform",
        metavar="NAME",
        help="run the conformance kit against the installed platform plugin NAME (its entry point "
        "name in pagellm.platform_plugins, or cpu); the backends given run on it",
    )
    group.addoption(
        "--pagellm-backend",
        metavar="NAME",
        action="append",
        default=[],
        help="run the conformance kit against the attention backend NAME (as --attention-backend "
        "takes it); may be given several times",
    )
    group.addoption(
        "--pagellm-fake-hardware",
        metavar="MODULE:NAME",
        help="with --pagellm-platform: fake the platform's hardware facts with the context manager "
        "MODULE:NAME() that its plugin provides (it yields a description of what it fakes); the "
        "cases that need a device skip",
    )


def requested(config: pytest.Config) -> bool:
    return bool(config.getoption("pagellm_platform") or config.getoption("pagellm_backend"))


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    """The conftest.py files of the directories above the kit's are not the kit's: a checkout
    with an editable install of pagellm has its own at its root."""
    options = early_config.known_args_namespace
    if options.pagellm_platform or options.pagellm_backend:
        options.confcutdir = str(KIT_DIR)


def pytest_configure(config: pytest.Config) -> None:
    if not requested(config):
        return
    # Imported only now: a pytest run without the options never imports pagellm through the kit.
    from pagellm.testing.conformance.faked_hardware import enter_faked_hardware
    from pagellm.testing.conformance.targets import Targets

    platform = config.getoption("pagellm_platform")
    faked = enter_faked_hardware(config, config.getoption("pagellm_fake_hardware"), platform)
    config.stash[TARGETS] = Targets.resolve(platform, config.getoption("pagellm_backend"), faked)


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session: pytest.Session) -> bool | None:
    """The kit's cases, instead of the paths pytest would collect."""
    if not requested(session.config):
        return None
    session.perform_collect([str(KIT_DIR)])
    return True


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    """The kit's cases even where the project's ``python_files`` would not match their names
    (where it does, pytest's own hook collects them)."""
    patterns = parent.config.getini("python_files")
    if file_path in CASES and not any(fnmatch(file_path.name, p) for p in patterns):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_report_header(config: pytest.Config) -> list[str]:
    return config.stash[TARGETS].header() if requested(config) else []
