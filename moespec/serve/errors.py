"""Errors the HTTP API returns, in the OpenAI error JSON shape.

``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`` with the HTTP status,
so OpenAI clients raise their usual typed exceptions (BadRequestError, NotFoundError, ...).
"""

from __future__ import annotations

from starlette.responses import JSONResponse


class ApiError(Exception):
    """An error answered to the client; the server keeps serving.

    Args:
        status: HTTP status code (400, 401, 404, 413, 429, 500).
        message: what is wrong, naming the offending value.
        param: the request field at fault, or None.
        code: a short machine-readable code (e.g. "model_not_found"), or None.
        headers: extra response headers (e.g. Retry-After).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def kind(self) -> str:
        """The OpenAI error "type" for this status."""
        return {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
                500: "server_error"}.get(self.status, "invalid_request_error")

    def body(self) -> dict:
        """The JSON body."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The HTTP response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)
