"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with a matching HTTP status.

The types are OpenAI's (`invalid_request_error`, `authentication_error`, `rate_limit_error`, `server_error`), so the
official SDK raises its usual exception classes (BadRequestError, NotFoundError, RateLimitError, ...).
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A request the server answers with an error; the message says what was expected and what was found."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _default_type(status)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_param(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def kind_of(value: Any) -> str:
    """What a client sent, in JSON's words ("a string", "an array"), not Python's type names."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return "a file" if hasattr(value, "data") else "a value of another kind"


def shown(value: Any, limit: int = 40) -> str:
    """A client's value for an error message: its kind, and its text cut to `limit` characters where short."""
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        try:
            text = repr(value)
        except ValueError:  # an integer too long to print
            return kind_of(value)
        return f"{kind_of(value)} {text if len(text) <= limit else text[: limit - 3] + '...'}"
    return kind_of(value)
