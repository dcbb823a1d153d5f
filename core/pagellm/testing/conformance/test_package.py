"""Package metadata and plugin API: the plugin is an entry point of an installed distribution that
depends on pagellm, pagellm's loader loads it, it declares a plugin API version this pagellm
accepts, and its classes fit the interfaces they subclass (`pagellm.plugins.interface_check`)."""

from __future__ import annotations

import pytest

from pagellm.attention.backend import AttentionImpl, AttentionMetadataBuilder
from pagellm.attention.backends.torch_sdpa import TorchSDPABackend
from pagellm.platforms import CPU, platforms
from pagellm.platforms.interface import Platform
from pagellm.plugins.groups import ATTENTION, PLATFORM
from pagellm.plugins.hookspecs import PLUGIN_API_VERSION
from pagellm.plugins.interface_check import interface_mismatches
from pagellm.testing.conformance.compare import ConformanceFailure
from pagellm.testing.conformance.targets import (
    PLATFORM_CLASS_ATTRIBUTE,
    BackendTarget,
    PlatformTarget,
    PluginPackage,
    requires_pagellm,
)


def _installed(target: PlatformTarget | BackendTarget, group: str) -> PluginPackage:
    if target.name in (CPU, TorchSDPABackend.name):
        pytest.skip(f"{target.name} is built into pagellm: it has no package of its own")
    if target.package is None:
        raise ConformanceFailure(
            target.problem or f"no installed plugin of group {group} registers {target.name!r}"
        )
    return target.package


def _check_loads(package: PluginPackage) -> None:
    record, who = package.record, f"plugin {package.entry_point!r} ({package.group})"
    problems = []
    if record.status != "loaded":
        problems.append(f"pagellm's loader answered {who} with {record.status!r}: {record.reason}")
    if not package.distribution or not package.version:
        problems.append(f"{who} comes from no distribution with a name and a version")
    elif not requires_pagellm(package):
        problems.append(
            f"distribution {package.distribution} does not declare its dependency on pagellm "
            '(add "pagellm" to [project] dependencies)'
        )
    if problems:
        raise ConformanceFailure("; ".join(problems))


def _check_api_version(package: PluginPackage) -> None:
    declared = package.record.api_version
    if declared is None:  # the loader refused it: its reason says why
        raise ConformanceFailure(
            f"plugin {package.entry_point!r} declares no plugin API version pagellm "
            f"{PLUGIN_API_VERSION} accepts: {package.record.reason}"
        )
    (major, minor), (core_major, core_minor) = (
        (int(x) for x in v.split(".")) for v in (declared, PLUGIN_API_VERSION)
    )
    if major != core_major or minor > core_minor:
        raise ConformanceFailure(
            f"plugin {package.entry_point!r} targets plugin API {declared}; this pagellm "
            f"provides {PLUGIN_API_VERSION} (same major, minor up to it)"
        )


def _mismatches(base: type, cls: type) -> list[str]:
    if not issubclass(cls, base):
        return [f"{cls.__qualname__} is not a {base.__name__} subclass"]
    return [f"{cls.__qualname__}: {p}" for p in interface_mismatches(base, cls)]


def test_platform_is_an_installed_plugin_that_loads(platform: PlatformTarget) -> None:
    _check_loads(_installed(platform, PLATFORM))


def test_platform_declares_a_plugin_api_this_pagellm_accepts(platform: PlatformTarget) -> None:
    _check_api_version(_installed(platform, PLATFORM))


def test_platform_class_fits_the_platform_interface(platform: PlatformTarget) -> None:
    if platform.cls is None:  # the other platform cases skip for this reason
        raise ConformanceFailure(str(platform.problem))
    cls = platform.cls
    problems = _mismatches(Platform, cls)
    if getattr(cls, "name", None) != platform.name:
        problems.append(
            f"{cls.__qualname__}.name is {getattr(cls, 'name', None)!r}: use the plugin name "
            f"{platform.name!r} (messages name the platform by it)"
        )
    if platform.active and platform.package is not None:
        answered = platform.package.record.result
        declared = getattr(platform.package.module(), PLATFORM_CLASS_ATTRIBUTE, None)
        if declared is not None and declared != answered:
            problems.append(
                f"its hook answers {answered!r} but its module declares "
                f"{PLATFORM_CLASS_ATTRIBUTE} = {declared!r}"
            )
        platforms.get(platform.name)  # the lookup the engine makes: raises with the reasons
    if problems:
        raise ConformanceFailure("; ".join(problems))


def test_faked_hardware_makes_the_platform_active(platform: PlatformTarget) -> None:
    """With ``--pagellm-fake-hardware``: the plugin's fake is what its detection reads."""
    if platform.faked is None:
        pytest.skip("no --pagellm-fake-hardware given")
    if not platform.active:
        raise ConformanceFailure(str(platform.inactive_reason))


def test_backend_is_an_installed_plugin_that_loads(backend: BackendTarget) -> None:
    _check_loads(_installed(backend, ATTENTION))


def test_backend_declares_a_plugin_api_this_pagellm_accepts(backend: BackendTarget) -> None:
    _check_api_version(_installed(backend, ATTENTION))


def test_backend_classes_fit_their_interfaces(backend: BackendTarget) -> None:
    """The backend class passed the registry's lookup (interface and name) when it was resolved;
    its impl and metadata builder are checked here."""
    cls = backend.require_class()
    problems = _mismatches(AttentionImpl, cls.get_impl_cls())
    problems += _mismatches(AttentionMetadataBuilder, cls.get_builder_cls())
    if problems:
        raise ConformanceFailure("; ".join(problems))
