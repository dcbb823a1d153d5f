"""OpenAI-style HTTP errors: ``{"error": {"message", "type", "param", "code"}}``.

Route handlers (the server's and the endpoint plugins') raise `APIError`; the API server turns it,
and every other error it knows (validation, unknown route, dead engine), into this body.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


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
