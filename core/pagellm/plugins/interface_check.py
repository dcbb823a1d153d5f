"""Does a plugin's class fit the interface it subclasses? Checked when a registry first hands the
class out, so a wrong signature is an error naming the plugin, not a `TypeError` deep in a worker.

Generic on purpose: every public method the base class defines (or inherits from another pagellm
class) is compared, so a hook added to an interface is checked without a change here.
"""

from __future__ import annotations

import inspect
from typing import Any

_KINDS = {classmethod: "a class method", staticmethod: "a static method"}
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _defined(cls: type, name: str) -> Any:
    """The attribute as written in the class body (a classmethod object, a function...)."""
    return next((vars(k)[name] for k in cls.__mro__ if name in vars(k)), None)


def _kind(attr: Any) -> str:
    return _KINDS.get(type(attr), "a method" if inspect.isfunction(attr) else "no method")


def _params(cls: type, name: str) -> list[inspect.Parameter]:
    params = list(inspect.signature(getattr(cls, name)).parameters.values())
    return params[1:] if inspect.isfunction(_defined(cls, name)) else params  # without ``self``


def _fits(base: list[inspect.Parameter], impl: list[inspect.Parameter]) -> bool:
    """The override takes the base's parameters (same names and kinds, a default wherever the
    base has one), then only optional ones."""
    head, extra = impl[: len(base)], impl[len(base) :]
    return (
        [(p.name, p.kind) for p in head] == [(p.name, p.kind) for p in base]
        and all(
            b.default is b.empty or p.default is not p.empty
            for b, p in zip(base, head, strict=False)
        )
        and all(p.default is not p.empty or p.kind in _VARIADIC for p in extra)
    )


def _call(cls: type, name: str) -> str:
    params = ", ".join(str(p.replace(annotation=p.empty)) for p in _params(cls, name))
    return f"{cls.__name__}.{name}({params})"


def interface_mismatches(base: type, cls: type) -> list[str]:
    """The public methods of ``base`` that ``cls`` overrides with another kind (class method,
    static method, method) or with a signature that cannot take the base's calls."""
    # Only pagellm's own classes are a contract: a library base (nn.Module) is not checked.
    names = {
        name
        for k in base.__mro__
        if k.__module__.startswith("pagellm.")
        for name, value in vars(k).items()
        if not name.startswith("_") and _kind(value) != "no method"
    }
    problems = []
    for name in sorted(names):
        expected, actual = _defined(base, name), _defined(cls, name)
        if _kind(actual) != _kind(expected):
            problems.append(
                f"{name} is {_kind(actual)}, {base.__name__}.{name} is {_kind(expected)}"
            )
        elif actual is not expected and not _fits(_params(base, name), _params(cls, name)):
            problems.append(f"{_call(cls, name)} cannot be called as {_call(base, name)}")
    return problems
