"""/openapi.json as the server behaves: a bad request body is a 400 with the OpenAI error
object (FastAPI documents its default 422, which this server never sends)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"]}}}},
}
_ERRORS = {"400": "invalid request", "401": "bad or missing API key",
           "404": "unknown model or conversation", "409": "conversation busy",
           "413": "request body too large", "429": "too many requests queued",
           "503": "shutting down"}


def document_errors(app: FastAPI) -> None:
    """Replace FastAPI's 422 responses by the errors each operation can answer."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        doc.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
        ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        for path, ops in doc.get("paths", {}).items():
            for op in ops.values():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                codes = ["400", "401"]
                if path.startswith("/v1/") and "{cid}" in path:
                    codes += ["404", "409"]
                if path in ("/v1/chat/completions", "/v1/completions"):
                    codes += ["404", "409", "413", "429", "503"]
                if path == "/health":
                    codes = []
                for c in codes:
                    responses[c] = {"description": _ERRORS[c], **ref}
        doc["components"]["schemas"].pop("HTTPValidationError", None)
        doc["components"]["schemas"].pop("ValidationError", None)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
