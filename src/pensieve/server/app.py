"""The OpenAI-compatible HTTP API over the stateful engine.

Conversations, two ways. A client that re-sends the whole message list each turn (any OpenAI
client) is recognised: the longest prefix of its messages that ends with an assistant message
and equals a stored conversation of the same tenant gives the turn that conversation's history
and KV, in a new conversation of its own (:mod:`.engine_ids`: a history matched is a cache hit,
not an identity, so two users of one key never share a conversation). A client that names
``conversation_id`` (body field or ``X-Conversation-Id`` header) sends only the new messages
and continues that conversation. ``/v1/completions`` (token ids or text, no chat template)
starts one only when asked (``create_conversation: true``) and continues it by
``conversation_id`` with the new tokens. Either way the response carries the conversation
id, and only tokens whose KV is not cached are computed. Conversations belong to the API key
that created them.

Protection: a body over ``max_request_bytes`` is a 413 before it is read; past
``max_queued_requests`` requests waiting for their first token, a new one is a 429 with
``Retry-After``; rendering and tokenization run in a thread pool, never on the event loop.
Every error is OpenAI-shaped JSON (:mod:`.errors`).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pensieve.server import engine_ops
from pensieve.server.chat_run import answer_chat
from pensieve.server.completions_run import answer_completion
from pensieve.server.conversation_names import stored_id
from pensieve.server.errors import APIError, error_body, error_response
from pensieve.server.fields import check_fields, check_message_fields
from pensieve.server.openapi import document_errors
from pensieve.server.priority import settle_priorities
from pensieve.server.protocol import (
    INVALID_UNICODE,
    ChatCompletionRequest,
    CompletionRequest,
    _Sampling,
)
from pensieve.server.responses import add_response_routes
from pensieve.server.state import ServerState
from pensieve.server.store_sqlite import CorruptConversationError, StoreWriteError
from pensieve.server.token_routes import add_token_routes
from pensieve.server.turns import engine_call, off_loop, owned
from pensieve.server.vllm_compat import add_vllm_routes

log = logging.getLogger("pensieve.server")


def _tenant(state: ServerState, request: Request) -> str:
    if not state.api_keys:
        return "public"
    auth = request.headers.get("authorization", "")
    key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    if not key or not any(secrets.compare_digest(key, k) for k in state.api_keys):
        raise APIError(401, "missing or invalid API key", "authentication_error",
                       "invalid_api_key")
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _check_model(state: ServerState, model: str | None) -> None:
    """404 on a model that is neither a served name nor the model's path or directory name."""
    if model is not None and model not in state.names and model not in state.model_aliases:
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                       f"{list(state.names)}", code="model_not_found", param="model")


def _check_request(state: ServerState, body: _Sampling) -> None:
    """400 on a field asking for what is not implemented (:mod:`.fields`) or a retention
    hint past the server's bounds; 404 on an unknown model."""
    check_fields(body)
    settle_priorities(state, body)
    state.metrics.recorded.record(body)
    for name, value, bound in (("retention_priority", body.retention_priority,
                                state.max_priority),
                               ("keep_alive_s", body.keep_alive_s, state.max_keep_alive_s)):
        if value is not None and value > bound:
            raise APIError(400, f"{name} must be at most {bound:g} on this server, got "
                           f"{value:g}", param=name)
    _check_model(state, body.model)


def _conversation_id(body: _Sampling, request: Request) -> str | None:
    """The conversation a request names, by its body's ``conversation_id``, its
    ``X-Conversation-Id`` header or its ``X-Session-ID`` header (:mod:`.conversation_names`):
    a 400 when one is empty (it used to start a new conversation silently) or when they
    disagree (the body's used to win silently)."""
    given = [(where, value) for where, value in (
        ("conversation_id", body.conversation_id),
        ("X-Conversation-Id", request.headers.get("x-conversation-id")),
        ("X-Session-ID", request.headers.get("x-session-id"))) if value is not None]
    for where, value in given:
        if not value.strip():
            raise APIError(400, f"{where} is empty: name a conversation, or leave it out to "
                           "start one", param="conversation_id", code="invalid_conversation_id")
    for (w1, v1), (w2, v2) in zip(given, given[1:]):
        if v1 != v2:
            raise APIError(400, f"{w1} {v1!r} and {w2} {v2!r} disagree",
                           param="conversation_id", code="conversation_id_mismatch")
    return given[0][1] if given else None


async def _admitted(state: ServerState, fn: Callable[[], Awaitable[Response]]) -> Response:
    """Run a generation request under admission control (429 past the queue limit)."""
    if state.draining:
        raise APIError(503, "the server is shutting down", "server_error", "shutting_down")
    limit = state.max_queued_requests
    if limit is not None and state.queued >= limit:
        state.metrics.rejected.inc()
        raise APIError(429, f"the server has {state.queued} requests queued (limit {limit}); "
                       "retry later", "rate_limit_error", "queue_full",
                       headers={"Retry-After": "1"})
    state.queued += 1
    try:
        return await fn()
    finally:
        state.queued -= 1


def create_app(state: ServerState) -> FastAPI:
    """The app: OpenAI-shaped error handlers, then the routes in three groups (server
    information, conversations, generation), then the error responses in the OpenAPI document."""
    app = FastAPI(title="Pensieve", version="0.1.0")
    app.state.pensieve = state
    app.add_middleware(BodyLimit, limit=state.max_request_bytes)
    if state.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(state.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["x-conversation-id"])
    _add_error_handlers(app)
    _add_info_routes(app, state)
    add_token_routes(app, state, lambda m: _check_model(state, m), _tenant)
    _add_conversation_routes(app, state)
    _add_generation_routes(app, state)
    add_vllm_routes(app, state, lambda r: _tenant(state, r))
    add_response_routes(app, state, lambda r: _tenant(state, r),
                        lambda b: _check_request(state, b), lambda fn: _admitted(state, fn))
    document_errors(app)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI-shaped JSON: ours, validation (400), unhandled (500), routing."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        _log_refusal(request, e.status, e.code, e.param, e.message)
        return error_response(e.status, e.message, e.type, e.code, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        if first.get("type") == INVALID_UNICODE:
            loc = str((first.get("ctx") or {}).get("field")) or loc
        msg = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ()))}: {er.get('msg')}"
                        for er in errs[:5])
        _log_refusal(request, 400, first.get("type"), loc, msg)
        return error_response(400, msg or "invalid request", param=loc,
                              code=first.get("type") or None)

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:  # OpenAI-shaped 500s too
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail), "invalid_request_error")


def _log_refusal(request: Request, status: int, code: Any, param: Any, message: str) -> None:
    """A 4xx's reason in the server's log (the client's body only told the client)."""
    if 400 <= status < 500:
        log.info("%s %s -> %d %s (param %s): %s", request.method, request.url.path, status,
                 code, param, message[:300])


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    """``/health``, ``/metrics`` (Prometheus; without a key with ``metrics_public``) and
    ``/v1/models``."""

    @app.get("/health", response_model=None)
    async def health() -> dict[str, Any] | JSONResponse:
        snap = state.engine.snapshot
        if not state.engine.alive:
            if getattr(state.engine, "hung", False):
                return error_response(503, "the engine made no progress for more than "
                                      f"{state.engine.watchdog_s:g} s (--watchdog-timeout): "
                                      "the server restarts", "server_error", code="engine_hung")
            return error_response(503, "the engine is not running", "server_error",
                                  code="engine_down")
        store = await _store_health(state)
        status = ("draining" if state.draining else
                  "degraded" if state.store_error is not None else "ok")
        return {"status": status, "queued": state.queued,
                "engine_running": snap.running, "engine_waiting": snap.waiting,
                "max_queued_requests": state.max_queued_requests, "store": store}

    @app.api_route("/metrics", methods=["GET", "HEAD"], response_class=Response, responses={200: {
        "content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}})
    async def metrics(request: Request) -> Response:
        """Server-wide counters (every tenant's together), for the operator: with API keys
        set, only the ``--metrics-key`` reads them (or anyone, with ``--metrics-public``); a
        tenant reads its own traffic at ``/v1/usage``."""
        _check_operator(state, request)
        state.metrics.queued.set(state.queued)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/usage")
    async def usage(request: Request) -> dict[str, Any]:
        """The caller's own turns and tokens since the server started (:mod:`.usage`)."""
        return {"object": "usage", **state.usage.of(_tenant(state, request))}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        _tenant(state, request)
        return {"object": "list", "data": [_model_card(state, name) for name in state.names]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request) -> dict[str, Any]:
        """One model's card (``client.models.retrieve``): a served name, or an alias of the
        model (its path or directory name), as a request's ``model`` may give it."""
        _tenant(state, request)
        _check_model(state, model)
        return _model_card(state, model)


def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    card: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "pensieve",
                            "root": state.model_name, "max_model_len": state.max_model_len}
    if state.is_demo:
        card["description"] = "built-in demo model: random weights, not a trained LLM"
    return card


def _check_operator(state: ServerState, request: Request) -> None:
    """``/metrics``: open without API keys or with ``--metrics-public``; else the operator's
    ``--metrics-key`` only (401 without a key, 403 with a tenant's)."""
    if not state.api_keys or state.metrics_public:
        return
    auth = request.headers.get("authorization", "")
    key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    if state.metrics_key and key and secrets.compare_digest(key, state.metrics_key):
        return
    if key and any(secrets.compare_digest(key, k) for k in state.api_keys):
        raise APIError(403, "/metrics shows every tenant's traffic: it needs the operator's "
                       "key (--metrics-key) or --metrics-public; a key's own usage is at "
                       "/v1/usage", "permission_denied_error", "operator_only")
    raise APIError(401, "missing or invalid operator key for /metrics (--metrics-key)",
                   "authentication_error", "invalid_api_key")


async def _store_health(state: ServerState) -> dict[str, Any]:
    """``/health``'s ``store`` object. While a turn's write has failed, each call probes the
    store with a write, so that ``degraded`` ends as soon as the store writes again."""
    if state.store_error is not None:
        try:
            await off_loop(state, state.store.probe)
            state.store_error = None
        except StoreWriteError as e:
            state.store_error = e.message
    return {"writable": state.store_error is None, "error": state.store_error,
            "corrupt_conversations": state.corrupt_conversations}


def _add_conversation_routes(app: FastAPI, state: ServerState) -> None:
    """``GET`` and ``DELETE /v1/conversations/{cid}`` (the tenant's own conversations only)."""

    @app.get("/v1/conversations/{cid}")
    async def get_conversation(cid: str, request: Request) -> dict[str, Any]:
        tenant = _tenant(state, request)
        conv = owned(state, stored_id(tenant, cid), tenant)
        return {"id": conv.id, "object": "conversation", "messages": conv.messages,
                "token_ids": conv.token_ids, "turns": conv.turns,
                "retention_priority": conv.priority, "priority": conv.priority,
                "keep_alive_s": conv.keep_alive_s, "created": conv.created,
                "updated": conv.updated}

    @app.delete("/v1/conversations/{cid}")
    async def delete_conversation(cid: str, request: Request) -> dict[str, Any]:
        tenant = _tenant(state, request)
        cid = stored_id(tenant, cid)
        try:
            owned(state, cid, tenant)
        except CorruptConversationError:
            pass  # its owner (or anyone, when the row is unreadable) may delete it

        await engine_call(state, engine_ops.drop_conversation, state.engine_ids.of(cid))
        state.engine_ids.forget(cid)
        state.store.delete(cid)
        return {"id": cid, "object": "conversation.deleted", "deleted": True}


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    """``/v1/chat/completions`` and ``/v1/completions``, under admission control."""

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        tenant = _tenant(state, request)
        _check_request(state, body)
        check_message_fields(body.messages)
        cid = _conversation_id(body, request)
        return await _admitted(state, lambda: answer_chat(state, body, tenant, cid, request))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        tenant = _tenant(state, request)
        _check_request(state, body)
        cid = _conversation_id(body, request)
        return await _admitted(state, lambda: answer_completion(state, body, tenant, cid,
                                                                request))


class _TooLarge(StarletteHTTPException):
    pass


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is a 413, from its
    Content-Length before anything is read, or as soon as the streamed body passes it."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            body = error_body(413, f"the request body ({int(declared)} bytes) exceeds the "
                              f"limit of {self.limit} bytes", code="request_too_large")
            await send({"type": "http.response.start", "status": 413,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        seen = 0

        async def limited() -> Any:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge(413, f"the request body exceeds the limit of {self.limit} "
                                    "bytes")
            return msg

        await self.app(scope, limited, send)
