"""The OpenAI error shape: an APIError raised anywhere in the server is answered as
{"error": {"message", "type", "param", "code"}} with its HTTP status.

Offers: APIError, error_body.
"""

from __future__ import annotations


class APIError(Exception):
    """An error answered to the client as an OpenAI error object with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             422: "invalid_request_error", 429: "rate_limit_error"}.get(status, "server_error")
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
