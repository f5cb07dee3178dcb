"""OpenAI-shaped errors: every non-2xx answer is ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse


class _ErrorJSON(JSONResponse):
    def render(self, content: Any) -> bytes:  # ASCII: a message may quote invalid text
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


class APIError(Exception):
    """Raised anywhere in a request; the app answers it as an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = (
            status, message, type_, code, param)
        self.headers = headers


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return _ErrorJSON(status_code=status, headers=headers, content={
        "error": {"message": message, "type": type_, "param": param, "code": code}})


def error_body(status: int, message: str, type_: str = "invalid_request_error",
               code: str | None = None) -> bytes:
    """The same error as raw JSON bytes (for a pure ASGI middleware)."""
    return bytes(error_response(status, message, type_, code).body)
