"""Does a plugin's class fit the interface it subclasses? Checked when a registry first hands the
class out, so a wrong signature is an error naming the plugin, not a `TypeError` deep in a worker.

Generic on purpose: every public method the base class defines (or inherits from another pagellm
class) is compared, so a hook added to an interface is checked without a change here.
"""

from __future__ import annotations

import inspect
from typing import Any

_P = inspect.Parameter
_KINDS = {classmethod: "a class method", staticmethod: "a static method"}


def _defined(cls: type, name: str) -> Any:
    """The attribute as written in the class body (a classmethod object, a function...)."""
    return next(vars(k)[name] for k in cls.__mro__ if name in vars(k))


def _contract(base: type) -> list[type]:
    # Only pagellm's own classes are a contract: a library base (nn.Module) is not checked.
    return [k for k in base.__mro__ if k.__module__.startswith("pagellm.")]


def _interface(base: type) -> set[str]:
    return {
        name
        for k in _contract(base)
        for name, value in vars(k).items()
        if not name.startswith("_") and (inspect.isfunction(value) or type(value) in _KINDS)
    }


def _signature(cls: type, name: str) -> inspect.Signature:
    sig = inspect.signature(getattr(cls, name))
    if inspect.isfunction(_defined(cls, name)):  # drop ``self``, whatever the plugin calls it
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    return sig


def _plain(sig: inspect.Signature) -> str:
    """The signature without annotations (they are strings under postponed evaluation)."""
    return str(
        sig.replace(
            parameters=[p.replace(annotation=_P.empty) for p in sig.parameters.values()],
            return_annotation=inspect.Signature.empty,
        )
    )


def _calls(sig: inspect.Signature) -> list[tuple[list[None], dict[str, None]]]:
    """The calls the core may make to a method of this signature: every argument by position,
    every argument by keyword, and the required arguments alone."""
    params = [
        p for p in sig.parameters.values() if p.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)
    ]
    positional = [p for p in params if p.kind in (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)]
    keyword = [p for p in params if p.kind == _P.KEYWORD_ONLY]
    only_positional = [None for p in params if p.kind == _P.POSITIONAL_ONLY]
    by_name = [p for p in params if p.kind != _P.POSITIONAL_ONLY]
    required = [p for p in positional if p.default is _P.empty]
    return [
        ([None] * len(positional), dict.fromkeys(p.name for p in keyword)),
        (only_positional, dict.fromkeys(p.name for p in by_name)),
        ([None] * len(required), dict.fromkeys(p.name for p in keyword if p.default is _P.empty)),
    ]


def interface_mismatches(base: type, cls: type) -> list[str]:
    """How ``cls`` fails the interface of ``base``: class variables the base declares without a
    value that ``cls`` leaves unset, and overridden methods of another kind (class method, static
    method, method) or that cannot take every call the base's signature allows."""
    problems = [
        f"{name} is not set ({base.__name__} declares it)"
        for k in _contract(base)
        for name, annotation in vars(k).get("__annotations__", {}).items()
        if "ClassVar" in str(annotation) and not hasattr(base, name) and not hasattr(cls, name)
    ]
    for name in sorted(_interface(base)):
        expected, actual = _defined(base, name), _defined(cls, name)
        if actual is expected:
            continue
        if type(actual) is not type(expected):
            kind = _KINDS.get(
                type(actual), "a method" if inspect.isfunction(actual) else "no method"
            )
            problems.append(
                f"{name} is {kind}, {base.__name__}.{name} is {_KINDS.get(type(expected), 'a method')}"
            )
            continue
        base_sig, sig = _signature(base, name), _signature(cls, name)
        for args, kwargs in _calls(base_sig):
            try:
                sig.bind(*args, **kwargs)
            except TypeError:
                problems.append(
                    f"{name}{_plain(sig)} cannot be called as {base.__name__}.{name}{_plain(base_sig)}"
                )
                break
    return problems
