"""A registry of classes by name, filled with qualified names (``"package.module:Class"``) and
importing a class only when it is looked up; the registry loads its plugin group first."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class ClassRegistry(Generic[T]):
    def __init__(self, what: str, base: type[T], load_plugins: Callable[[], object]) -> None:
        self.what = what
        self.base = base
        self._load_plugins = load_plugins
        self._entries: dict[str, str] = {}

    def register(self, name: str, qualname: str) -> None:
        """Register ``"package.module:Class"`` under ``name`` (last registration wins)."""
        self._entries[name] = qualname

    def names(self) -> list[str]:
        self._load_plugins()
        return sorted(self._entries)

    def get(self, name: str) -> type[T]:
        if name not in self.names():
            installed = ", ".join(self.names()) or "none installed"
            raise ValueError(f"{self.what} {name!r} is not installed ({installed}).")
        module_name, _, cls_name = self._entries[name].partition(":")
        cls = getattr(importlib.import_module(module_name), cls_name)
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise TypeError(
                f"{self._entries[name]} registered as {self.what} {name!r} is not a {self.base.__name__}."
            )
        return cls
