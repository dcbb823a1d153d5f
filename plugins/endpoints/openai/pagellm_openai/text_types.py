"""The scalar types of the API's requests: text that is really text (no lone UTF-16 surrogates,
which JSON can carry but no encoding can), and integers the engine's wire carries (msgpack int64)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, Field

from pagellm.sampling_params import INT64_MAX, INT64_MIN


def no_lone_surrogates(text: str) -> str:
    """JSON can carry lone UTF-16 surrogates (``"\\ud800"``), which no text encodes: refused."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"contains a lone surrogate (U+{ord(text[exc.start]):04X}), which is not text"
            ) from None
    return text


def check_strings(value: Any, where: str) -> None:
    if isinstance(value, str):
        try:
            no_lone_surrogates(value)
        except ValueError as exc:
            raise ValueError(f"{where} {exc}") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_strings(key, where)
            check_strings(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_strings(item, f"{where}[{i}]")


Text = Annotated[str, AfterValidator(no_lone_surrogates)]
# Integers the engine's wire carries (msgpack int64).
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
