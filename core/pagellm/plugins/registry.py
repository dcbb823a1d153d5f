"""`Registry`: classes of one kind by name (platforms, attention backends, models, quantization
methods, scheduling policies, IO processors, stat loggers).

Entries are class paths, ``"pkg.module:Class"`` or ``"pkg.module.Class"``, imported only when
looked up. The first lookup loads the registry's plugin group and registers what its plugins'
hooks returned, in whichever process makes it; built-ins are registered the same way, at import.
"""

from __future__ import annotations

import importlib
from typing import Any, Generic, TypeVar

from pagellm.plugins.interface_check import interface_mismatches
from pagellm.plugins.loader import PluginError, PluginRecord, load_group

T = TypeVar("T")


class NotRegisteredError(ValueError):
    """No built-in and no loaded plugin registered that name."""


def import_class(path: str) -> Any:
    module, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


class Registry(Generic[T]):
    def __init__(self, kind: str, base: type, group: str, *, named: bool = False) -> None:
        """``named``: a class's ``name`` must be the name it is registered under (attention
        backends: the worker looks the chosen one up again by its ``name``)."""
        self.kind = kind
        self.base = base
        self.group = group
        self.named = named
        self._entries: dict[str, tuple[str, PluginRecord | None]] = {}
        self._classes: dict[str, type[T]] = {}
        self._loaded = False

    def register(self, name: str, path: str, record: PluginRecord | None = None) -> None:
        """Register a class path under ``name`` (last registration wins); ``record``: the plugin
        that registered it, named when the class does not fit."""
        self._entries[name] = (path, record)
        self._classes.pop(name, None)

    def _load_group(self) -> None:
        if self._loaded:
            return
        self._loaded = True  # first: a general plugin's hook registers into its registry
        for record in load_group(self.group):
            if record.status == "loaded" and record.result is not None:
                result = record.result
                for name, path in (
                    result if isinstance(result, dict) else {record.name: result}
                ).items():
                    self.register(name, path, record)

    def names(self) -> list[str]:
        """Registered names, in registration order."""
        self._load_group()
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def get(self, name: str) -> type[T]:
        if name in self._classes:
            return self._classes[name]
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
        problems = self._problems(name, cls)
        if problems:
            raise PluginError(f"{what} {'; '.join(problems)}")
        self._classes[name] = cls
        return cls

    def _problems(self, name: str, cls: Any) -> list[str]:
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            return [f"is not a {self.base.__name__} subclass"]
        problems = []
        mismatches = interface_mismatches(self.base, cls)
        if mismatches:
            problems.append(f"does not fit {self.base.__name__}: {'; '.join(mismatches)}")
        if self.named and getattr(cls, "name", None) != name:
            problems.append(f"is named {getattr(cls, 'name', None)!r}: register it under that name")
        return problems

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
                earlier = record.reason if record.status == "misregistered" else None
                record.status = "misregistered"
                record.reason = f"{earlier}; {exc}" if earlier else str(exc)
