"""What the kit runs against: the platform and attention backends named on the command line,
found among the installed plugins, with what can and cannot be checked on this machine.

Resolution never raises for a broken plugin: what went wrong is kept (``problem``) and the cases
that need it fail with it, while the others still run.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from packaging.requirements import Requirement

from pagellm.attention.backend import AttentionBackend
from pagellm.attention.backends.torch_sdpa import TorchSDPABackend
from pagellm.attention.registry import attention_backends
from pagellm.platforms import CPU, current_platform_name, platforms
from pagellm.platforms.interface import Platform
from pagellm.plugins.groups import ATTENTION, PLATFORM
from pagellm.plugins.loader import PluginRecord, discover, load_group
from pagellm.plugins.registry import import_class

PLATFORM_CLASS_ATTRIBUTE = "pagellm_platform_class"
"""What a platform plugin's module may declare: the class path its hook answers when the hardware
is present, so that the platform's declarations can be checked where it is inactive."""


@dataclass(frozen=True)
class PluginPackage:
    """The installed plugin that provides a target, and how pagellm's loader answered it."""

    group: str
    entry_point: str
    value: str
    distribution: str | None
    version: str | None
    requires: list[str]
    record: PluginRecord

    def module(self) -> Any:
        """The plugin's module (the entry point's value), as the loader imported it."""
        return importlib.import_module(self.value)

    @classmethod
    def find(cls, group: str, provides: str) -> PluginPackage | None:
        """The plugin of ``group`` whose entry point is named ``provides`` (platforms) or whose
        hook registered ``provides`` (attention backends)."""
        entry_points = {ep.name: ep for ep in discover(group)}
        for record in load_group(group):
            result = record.result
            if record.name == provides or (isinstance(result, dict) and provides in result):
                ep = entry_points[record.name]
                dist = getattr(ep, "dist", None)
                requires = list(dist.requires or []) if dist is not None else []
                return cls(
                    group, ep.name, ep.value, record.distribution, record.version, requires, record
                )
        return None


@dataclass
class PlatformTarget:
    name: str
    package: PluginPackage | None
    """None: the built-in CPU platform."""
    cls: type[Platform] | None = None
    problem: str | None = None
    """Why ``cls`` is None: the plugin is not installed, did not load, or names no class."""
    active: bool = False
    inactive_reason: str | None = None
    faked: str | None = None
    """What ``--pagellm-fake-hardware`` fakes (its description), when it was given."""

    @classmethod
    def resolve(cls, name: str, faked: str | None = None) -> PlatformTarget:
        if name == CPU:
            return cls(name, None, platforms.get(CPU), active=True, faked=faked)
        package = PluginPackage.find(PLATFORM, name)
        target = cls(name, package, faked=faked)
        if package is None:
            names = ", ".join(ep.name for ep in discover(PLATFORM)) or "none"
            target.problem = (
                f"no installed distribution declares platform plugin {name!r} (group {PLATFORM}; "
                f"installed: {names}): pip install the plugin's package first"
            )
            return target
        record = package.record
        if record.status != "loaded":
            target.problem = (
                f"pagellm did not load plugin {name!r}: {record.status}: {record.reason}"
            )
            return target
        declared = getattr(package.module(), PLATFORM_CLASS_ATTRIBUTE, None)
        target.active = record.result is not None
        path = record.result if target.active else declared
        if not target.active and faked is not None:
            target.inactive_reason = (
                f"platform {name!r} is inactive even with the faked hardware of "
                f"--pagellm-fake-hardware ({faked}): its plugin answered None "
                f"({package.record.reason})"
            )
        elif not target.active:
            target.inactive_reason = (
                f"platform {name!r} is inactive on this machine (its plugin answered None: its "
                "hardware is not present); a platform is active only where its plugin detects its "
                "hardware and the kit cannot force it on, so this case runs where it is active"
            )
        if path is None:
            target.problem = (
                f"platform {name!r} is inactive here and its plugin module {package.value} "
                f"declares no {PLATFORM_CLASS_ATTRIBUTE} (the class path its hook answers when "
                "active), so its class cannot be checked here"
            )
            return target
        try:
            target.cls = import_class(path)
        except (ImportError, AttributeError, ValueError) as exc:
            target.problem = f"platform class {path} does not import: {type(exc).__name__}: {exc}"
        return target

    @property
    def device_unavailable(self) -> str | None:
        """Why nothing can run on the platform's device here (None: it can): the platform is
        inactive, or active only on faked hardware."""
        if not self.active:
            return self.inactive_reason or self.problem
        if self.faked is not None:
            return (
                f"platform {self.name!r} is active on faked hardware ({self.faked}): its "
                "decisions are checked, but no device is behind the facts, so the cases that run "
                "on its device skip"
            )
        return None

    def require_device(self) -> type[Platform]:
        """The class, for a case that runs on the platform's device; skips the case, saying why,
        where nothing can run on it here."""
        cls = self.require_class()
        if self.device_unavailable is not None:
            pytest.skip(self.device_unavailable)
        return cls

    def require_class(self) -> type[Platform]:
        """The class. A case needing it fails with the reason it is missing when the plugin did
        not load; when it loaded (inactive and naming no class, or naming one that does not
        import) the case skips with that reason, and `test_platform_class_fits_the_platform_
        interface` fails with it."""
        if self.cls is None:
            if self.package is not None and self.package.record.status == "loaded":
                pytest.skip(str(self.problem))
            raise AssertionError(self.problem)
        return self.cls


@dataclass
class BackendTarget:
    name: str
    package: PluginPackage | None
    """None: built into pagellm (TORCH_SDPA)."""
    device_type: str | None
    """The device type of the platform it runs on here (None: that platform has no class)."""
    platform_name: str
    cls: type[AttentionBackend] | None = None
    problem: str | None = None
    unusable: str | None = None
    """Why attention cannot run here (None: it can): the platform is inactive, the backend's
    libraries are missing, or it does not declare the platform's device type."""
    _device: Any = field(default=None, repr=False)
    _platform: type[Platform] | None = field(default=None, repr=False)

    @classmethod
    def resolve(cls, name: str, platform: PlatformTarget | None) -> BackendTarget:
        if platform is None:  # the platform this process resolves to
            platform_name = current_platform_name()
            platform_cls: type[Platform] | None = platforms.get(platform_name)
            no_device = None
        else:
            platform_name, platform_cls = platform.name, platform.cls
            no_device = platform.device_unavailable
        package = None if name == TorchSDPABackend.name else PluginPackage.find(ATTENTION, name)
        device_type = platform_cls.device_type if platform_cls is not None else None
        target = cls(name, package, device_type, platform_name, _platform=platform_cls)
        try:
            target.cls = attention_backends.get(name)
        except (ValueError, RuntimeError) as exc:  # not registered; does not import or fit
            target.problem = str(exc)
        target.unusable = target._why_unusable(no_device)
        return target

    def _why_unusable(self, no_device: str | None) -> str | None:
        if self.cls is None:
            return self.problem
        reasons = [] if no_device is None else [no_device]
        unavailable = self.cls.is_available()
        if unavailable:
            reasons.append(f"{self.name} is not available here: {unavailable}")
        if self.device_type not in self.cls.supported_device_types:
            reasons.append(
                f"{self.name} does not run on platform {self.platform_name!r} (device type "
                f"{self.device_type!r}; it declares {list(self.cls.supported_device_types)})"
            )
        return "; ".join(reasons) or None

    def require_class(self) -> type[AttentionBackend]:
        if self.cls is None:
            raise AssertionError(self.problem)
        return self.cls

    def skip_unless_usable(self) -> type[AttentionBackend]:
        """The class, for a case that runs attention; skips the case, saying why, where it
        cannot run here."""
        if self.unusable is not None:
            pytest.skip(self.unusable)
        return self.require_class()

    def device(self) -> torch.device:
        """The platform's device for rank 0 (made current on a GPU), once."""
        if self._device is None:
            if self._platform is None:
                raise AssertionError(f"platform {self.platform_name!r} has no class")
            self._device = self._platform.device(0)
        return self._device

    @property
    def platform_cls(self) -> type[Platform] | None:
        return self._platform


@dataclass
class Targets:
    platform: PlatformTarget | None
    backends: list[BackendTarget]

    @classmethod
    def resolve(
        cls, platform_name: str | None, backend_names: list[str], faked: str | None = None
    ) -> Targets:
        """Before anything reads ``current_platform``: an active platform under test is made the
        process's platform (``PAGELLM_PLATFORM``). ``faked``: the description of the faked
        hardware facts in place (`faked_hardware`)."""
        platform = PlatformTarget.resolve(platform_name, faked) if platform_name else None
        if platform is not None and platform.active:
            os.environ["PAGELLM_PLATFORM"] = platform.name
        backends = [BackendTarget.resolve(name, platform) for name in dict.fromkeys(backend_names)]
        return cls(platform, backends)

    def header(self) -> list[str]:
        """What ``pytest`` prints about the targets before the cases run."""
        lines = []
        if self.platform is not None:
            p = self.platform
            state = "active" if p.active else "inactive"
            if p.active and p.faked is not None:
                state = f"active on faked hardware: {p.faked}"
            lines.append(
                f"pagellm platform under test: {p.name} ({state}{_package_text(p.package)})"
            )
        for b in self.backends:
            usable = f"; device cases skipped: {b.unusable}" if b.unusable else ""
            lines.append(
                f"pagellm attention backend under test: {b.name} on platform "
                f"{b.platform_name}{_package_text(b.package)}{usable}"
            )
        return lines


def _package_text(package: PluginPackage | None) -> str:
    if package is None:
        return ", built into pagellm"
    return f", {package.distribution} {package.version}, plugin API {package.record.api_version}"


def requires_pagellm(package: PluginPackage) -> bool:
    """The distribution declares its dependency on pagellm (``Requires-Dist``)."""
    return any(Requirement(r).name.lower() == "pagellm" for r in package.requires)
