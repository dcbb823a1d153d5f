"""`Registry`: classes of one kind by name (platforms, attention backends, models, quantization
methods, scheduling policies, IO processors, stat loggers).

Entries are class paths, ``"pkg.module:Class"`` or ``"pkg.module.Class"``, imported only when
looked up. The first lookup loads the registry's plugin group and registers what its plugins'
hooks returned, in whichever process makes it; built-ins are registered the same way, at import.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

from pagellm.plugins.interface_check import interface_mismatches
from pagellm.plugins.loader import PluginError, PluginRecord, load_group

T = TypeVar("T")


class NotRegisteredError(ValueError):
    """No built-in and no loaded plugin registered that name."""


def import_class(path: str) -> Any:
    module, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


@dataclass
class Registry(Generic[T]):
    kind: str
    base: type
    group: str
    named: bool = False
    """A class's ``name`` must be the name it is registered under (attention backends: the
    worker looks the chosen one up again by its ``name``)."""
    _entries: dict[str, tuple[str, PluginRecord | None]] = field(default_factory=dict, init=False)
    _loaded: bool = field(default=False, init=False)

    def register(self, name: str, path: str, record: PluginRecord | None = None) -> None:
        """Register a class path under ``name`` (last registration wins); ``record``: the plugin
        that registered it, named when the class does not fit."""
        self._entries[name] = (path, record)

    def names(self) -> list[str]:
        """Registered names, in registration order."""
        if not self._loaded:
            self._loaded = True  # first: a general plugin's hook registers into its registry
            for record in load_group(self.group):
                if record.status != "loaded" or record.result is None:
                    continue  # failed or skipped, an inactive platform, a general plugin
                # A platform plugin names one class, registered under the plugin's name.
                result = record.result
                entries = result if isinstance(result, dict) else {record.name: result}
                for name, path in entries.items():
                    self.register(name, path, record)
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def get(self, name: str) -> type[T]:
        if name not in self.names():
            installed = ", ".join(self._entries) or "none"
            raise NotRegisteredError(
                f"{self.kind} {name!r} is not installed; installed: {installed}."
            )
        path, record = self._entries[name]
        what = f"{self.kind} {name!r} ({path}"
        what += f", from plugin {record.name!r} of {record.distribution})" if record else ")"
        try:
            cls = import_class(path)
        except (ImportError, AttributeError, ValueError) as exc:
            raise PluginError(f"{what} does not import: {type(exc).__name__}: {exc}") from exc
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise PluginError(f"{what} is not a {self.base.__name__} subclass")
        problems = interface_mismatches(self.base, cls)
        if self.named and getattr(cls, "name", None) != name:
            problems.append(f"its name is {getattr(cls, 'name', None)!r}, not {name!r}")
        if problems:
            raise PluginError(f"{what} does not fit {self.base.__name__}: {'; '.join(problems)}")
        return cast("type[T]", cls)

    def check(self) -> None:
        """Look up every class a plugin registered: a plugin with one that fails becomes
        "misregistered", with the reasons."""
        for name in self.names():
            record = self._entries[name][1]
            if record is None:
                continue
            try:
                self.get(name)
            except PluginError as exc:
                earlier = [record.reason or ""] if record.status == "misregistered" else []
                record.status, record.reason = "misregistered", "; ".join([*earlier, str(exc)])
