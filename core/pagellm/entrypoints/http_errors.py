"""OpenAI-style HTTP errors: ``{"error": {"message", "type", "param", "code"}}``.

Route handlers (the server's and the endpoint plugins') raise `APIError`; `install_error_handlers`
turns it, and every other error the server knows (validation, an IO processor's
`IOProcessorInputError`, unknown route, dead engine, overload, shutdown), into this body. A failure inside the server is `internal_error`: the client
learns the request id, the log gets the details.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from pagellm.engine.errors import EngineDeadError, EngineOverloadedError, EngineShuttingDownError
from pagellm.io_processors import IOProcessorInputError

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
UNKNOWN_PARAMETER = "unknown_parameter"
"""``code`` of a 400 for a field the request model does not declare."""
UNSUPPORTED_PARAMETER = "unsupported_parameter"
"""``code`` of a 400 for a field the server knows but does not implement; a request model's
validator raises a pydantic error of this type whose message says what the field asks for."""
RETRY_AFTER_S = 1


class APIError(Exception):
    """An error answered with ``status`` and an OpenAI-style JSON body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """HTTP 400, the answer to any request the server refuses to run."""
    return APIError(400, message, param=param, code=code)


def served_model_name(requested: str | None, served: list[str]) -> str:
    """The model name a response reports: the first served name when the request names none.
    A name the server does not serve gets HTTP 404 (``code: "model_not_found"``), as from
    OpenAI and vLLM."""
    if requested is None:
        return served[0]
    if requested not in served:
        raise APIError(
            404,
            f"The model {requested!r} does not exist; this server serves "
            f"{', '.join(repr(n) for n in served)}.",
            param="model",
            code="model_not_found",
        )
    return requested


def _path(loc: tuple[int | str, ...]) -> str:
    """A field's location as a client writes it: ``stream_options.include_usage``, ``prompt[2]``."""
    path = ""
    for part in loc:
        if part == "body" and not path:
            continue
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


def _validation_error(exc: RequestValidationError) -> APIError:
    """A 400 for the first validation error. An unknown field (``extra_forbidden``) or a field
    the server refuses (`UNSUPPORTED_PARAMETER`) is named by its full path, as ``param`` too,
    as OpenAI does; any other error names the offending top-level field as ``param``
    (``messages``, ``n``) and its full location in the message."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return bad_request(
            f"The request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
        )
    loc = tuple(first.get("loc", ()))
    path = _path(loc)
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    if first.get("type") == "extra_forbidden":
        return bad_request(
            f"Unknown parameter '{path}': this server does not support it.{more}",
            param=path,
            code=UNKNOWN_PARAMETER,
        )
    if first.get("type") == UNSUPPORTED_PARAMETER:
        return bad_request(
            f"{path} is not supported by this server ({first.get('msg')}).{more}",
            param=path,
            code=UNSUPPORTED_PARAMETER,
        )
    top = [p for p in loc if p != "body"]
    message = first.get("msg", "Invalid request.")
    if path:
        message = f"{path}: {message}"
    return bad_request(message + more, param=str(top[0]) if top else None)


def _request_id(request: Request) -> str:
    return str(getattr(request.state, "request_id", "") or "unknown")


def internal_error(request_id: str) -> APIError:
    """What a client learns of a failure inside the server: that it happened, and the id to
    find it in the server's log (where its details are)."""
    message = f"The server failed to handle the request (request id {request_id}); its log has"
    return APIError(500, message + " the details.", type=SERVER_ERROR)


def error_for(exc: Exception, request_id: str) -> APIError:
    """What a client learns of ``exc``: the engine's state (503: overloaded, shutting down, or
    stopped), else that the server failed (`internal_error`)."""
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, str(exc), type=SERVER_ERROR, code="server_overloaded")
    if isinstance(exc, EngineShuttingDownError):
        return APIError(503, str(exc), type=SERVER_ERROR, code="server_shutting_down")
    if isinstance(exc, EngineDeadError):
        return APIError(
            503,
            f"The engine has stopped (request id {request_id}); the server must be restarted.",
            type=SERVER_ERROR,
            code="engine_dead",
        )
    return internal_error(request_id)


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return exc.response()

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return _validation_error(exc).response()

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = str(exc.detail)
        not_served = getattr(request.app.state, "endpoints_not_served", None)
        if exc.status_code == 404 and message == "Not Found" and not_served:  # no such route:
            # it may be one of a plugin left out for the model's tasks; say which and why
            reasons = "; ".join(f"{name!r}: {why}" for name, why in sorted(not_served.items()))
            message += f" (endpoint plugins not served for this model: {reasons})"
        error = APIError(exc.status_code, message)
        return error.response(headers=dict(exc.headers or {}))

    async def io_input_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, IOProcessorInputError)
        return bad_request(str(exc), param=exc.param).response()

    async def engine_error(request: Request, exc: Exception) -> Response:
        error = error_for(exc, _request_id(request))
        retry = error.code == "server_overloaded"
        return error.response(headers={"Retry-After": str(RETRY_AFTER_S)} if retry else None)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(IOProcessorInputError, io_input_error)
    for engine_exc in (EngineDeadError, EngineOverloadedError, EngineShuttingDownError):
        app.add_exception_handler(engine_exc, engine_error)
