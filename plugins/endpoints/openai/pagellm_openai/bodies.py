"""Request bodies whose model depends on their shape (``/tokenize``, ``/invocations``): read as
JSON, then validated as the model their keys call for, refused as FastAPI refuses a typed body
(the same 400s, naming the same fields)."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from pagellm.entrypoints.http_errors import bad_request

M = TypeVar("M", bound=BaseModel)


async def json_body(raw: Request) -> Any:
    try:
        return json.loads(await raw.body())
    except ValueError as exc:  # also invalid UTF-8
        raise bad_request(f"The request body is not valid JSON: {exc}") from exc


def keys(body: Any) -> set[str]:
    """The top-level fields of a body (none when it is not an object: validation says why)."""
    return set(body) if isinstance(body, dict) else set()


def validated(model: type[M], body: Any) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        raise RequestValidationError(
            [{**error, "loc": ("body", *error["loc"])} for error in errors]
        ) from exc
