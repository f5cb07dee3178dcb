"""The OpenAI-compatible HTTP API over the stateful engine.

Conversations, two ways. A client that re-sends the whole message list each turn (any OpenAI
client) is recognised: the longest prefix of its messages that ends with an assistant message
and equals a stored conversation of the same tenant continues that conversation. A client
that names ``conversation_id`` (body field or ``X-Conversation-Id`` header) sends only the new
messages. ``/v1/completions`` (token ids or text, no chat template) starts one only when asked
(``create_conversation: true``) and continues it by ``conversation_id`` with the new tokens.
Either way the response carries the conversation id, and only tokens whose KV is not
cached are computed. Conversations belong to the API key that created them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2.exceptions import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pensieve.core.sampling_params import SamplingParams
from pensieve.core.scheduler import ConversationBusyError
from pensieve.engine.outputs import RequestOutput
from pensieve.server.async_engine import AsyncEngine
from pensieve.server.chat import ChatRenderer
from pensieve.server.metrics import Metrics
from pensieve.server.protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from pensieve.server.store import ConversationStore, StoredConversation

log = logging.getLogger("pensieve.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = (
            status, message, type_, code, param)


def _error(status: int, message: str, type_: str = "invalid_request_error",
           code: str | None = None, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={
        "error": {"message": message, "type": type_, "param": param, "code": code}})


@dataclass
class ServerState:
    engine: AsyncEngine
    store: ConversationStore
    renderer: ChatRenderer | None
    model_name: str
    is_demo: bool
    api_keys: tuple[str, ...]
    max_model_len: int
    metrics: Metrics


def _tenant(state: ServerState, request: Request) -> str:
    if not state.api_keys:
        return "public"
    auth = request.headers.get("authorization", "")
    key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    if not key or not any(secrets.compare_digest(key, k) for k in state.api_keys):
        raise APIError(401, "missing or invalid API key", "authentication_error",
                       "invalid_api_key")
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]


_SAMPLING_FIELDS = {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids"}


def _params(body: _Sampling, max_tokens: int, stop_ids: list[int]) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=body.temperature,
                          top_p=body.top_p, top_k=body.top_k, seed=body.seed,
                          stop_token_ids=tuple(stop_ids), ignore_eos=body.ignore_eos)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="Pensieve", version="0.1.0")
    app.state.pensieve = state

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return _error(e.status, e.message, e.type, e.code, e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        msg = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ()))}: {er.get('msg')}"
                        for er in errs[:5])
        return _error(400, msg or "invalid request", param=loc)

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:  # OpenAI-shaped 500s too
        log.exception("unhandled error")
        return _error(500, f"internal error: {type(e).__name__}: {e}", "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error(e.status_code, str(e.detail), "invalid_request_error")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        _tenant(state, request)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        _tenant(state, request)
        card: dict[str, Any] = {"id": state.model_name, "object": "model", "created": 0,
                                "owned_by": "pensieve", "max_model_len": state.max_model_len}
        if state.is_demo:
            card["description"] = "built-in demo model: random weights, not a trained LLM"
        return {"object": "list", "data": [card]}

    @app.get("/v1/conversations/{cid}")
    async def get_conversation(cid: str, request: Request) -> dict[str, Any]:
        conv = _owned(state, cid, _tenant(state, request))
        return {"id": conv.id, "object": "conversation", "messages": conv.messages,
                "token_ids": conv.token_ids, "turns": conv.turns, "priority": conv.priority,
                "keep_alive_s": conv.keep_alive_s, "created": conv.created,
                "updated": conv.updated}

    @app.delete("/v1/conversations/{cid}")
    async def delete_conversation(cid: str, request: Request) -> dict[str, Any]:
        _owned(state, cid, _tenant(state, request))

        def drop(eng: Any) -> None:
            conv = eng.cache.conversations.get(cid)
            if conv is not None and conv.running:
                raise ConversationBusyError(f"conversation {cid!r} has a turn running")
            eng.delete_conversation(cid)

        await _engine_call(state, drop)
        state.store.delete(cid)
        return {"id": cid, "object": "conversation.deleted", "deleted": True}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        tenant = _tenant(state, request)
        if state.renderer is None:
            raise APIError(400, "this model has no tokenizer: use /v1/completions with token ids")
        try:
            msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        cid = body.conversation_id or request.headers.get("x-conversation-id")
        turn = await _resolve_turn(state, tenant, cid, msgs)
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await _run(state, body, turn, max_tokens, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        tenant = _tenant(state, request)
        if isinstance(body.prompt, str):
            if state.renderer is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as token ids")
            ids = list(state.renderer.tokenizer.encode(body.prompt))
        else:
            ids = list(body.prompt)
        cid = body.conversation_id or request.headers.get("x-conversation-id")
        if cid is not None:
            stored = _owned(state, cid, tenant)
            await _restore(state, stored)
            turn = _Turn(tenant, cid, stored, [], [], ids, new_conversation=False)
        elif body.create_conversation:
            turn = _Turn(tenant, _new_conversation_id(), None, [], [], ids,
                         new_conversation=True)
        else:
            turn = _Turn(tenant, None, None, [], [], ids, new_conversation=False)
        return await _run(state, body, turn, body.max_tokens or 16, request, chat=False)

    return app


# ---------------------------------------------------------------------- conversations
@dataclass
class _Turn:
    tenant: str
    cid: str | None
    stored: StoredConversation | None
    prev: list[dict[str, Any]]
    new: list[dict[str, Any]]
    prompt_ids: list[int]
    """The new turn's tokens (the engine prepends the conversation's history), or with
    ``full_context`` the turn's whole context."""
    new_conversation: bool
    full_context: bool = False


def _new_conversation_id() -> str:
    """An unguessable id (it is also the conversation's handle, so it must not be enumerable)."""
    return "conv-" + secrets.token_urlsafe(18)


def _owned(state: ServerState, cid: str, tenant: str) -> StoredConversation:
    conv = state.store.get(cid)
    if conv is None or conv.tenant != tenant:  # another tenant's id looks like an unknown one
        raise APIError(404, f"conversation {cid!r} not found", code="conversation_not_found",
                       param="conversation_id")
    return conv


async def _engine_call(state: ServerState, fn: Any) -> Any:
    try:
        return await state.engine.call(fn)
    except ConversationBusyError as e:
        raise APIError(409, str(e), code="conversation_busy") from e
    except ValueError as e:
        raise APIError(400, str(e)) from e


async def _restore(state: ServerState, stored: StoredConversation) -> None:
    """Make sure the engine knows the conversation (after a restart: history, no KV)."""

    def fn(eng: Any) -> None:
        eng.restore_conversation(stored.id, stored.token_ids)
        eng.set_conversation_hints(stored.id, stored.priority, stored.keep_alive_s)

    await _engine_call(state, fn)


async def _resolve_turn(state: ServerState, tenant: str, cid: str | None,
                        msgs: list[dict[str, Any]]) -> _Turn:
    renderer = state.renderer
    assert renderer is not None
    stored: StoredConversation | None = None
    prev: list[dict[str, Any]] = []
    new = msgs
    if cid is not None:
        stored = _owned(state, cid, tenant)
        prev = stored.messages
    else:
        for k in range(len(msgs) - 1, 0, -1):
            if msgs[k - 1]["role"] != "assistant":
                continue
            found = state.store.find_by_messages(tenant, msgs[:k])
            if found is not None:
                cid, stored, prev, new = found, state.store.get(found), msgs[:k], msgs[k:]
                break
    if stored is not None:
        if not new:
            raise APIError(400, "no new message after the conversation's last answer",
                           param="messages")
        if any(m.get("role") == "completion" for m in prev):
            raise APIError(400, f"conversation {stored.id!r} was started on /v1/completions: "
                           "continue it there", param="conversation_id")
        context = _render(renderer, prev + new)
        await _restore(state, stored)
        return _Turn(tenant, stored.id, stored, prev, new, context, new_conversation=False,
                     full_context=True)
    return _Turn(tenant, _new_conversation_id(), None, [], new, _render(renderer, new),
                 new_conversation=True, full_context=True)


def _render(renderer: ChatRenderer, messages: list[dict[str, Any]]) -> list[int]:
    """The chat template's tokens for ``messages`` and the generation prompt: exactly what
    the model is fed (the engine keeps only the history's common prefix with it)."""
    try:
        return renderer.render(messages, add_generation_prompt=True)
    except TemplateError as e:  # e.g. a template that demands alternating roles
        raise APIError(400, f"the chat template refused the messages: {e}",
                       param="messages") from e


# ---------------------------------------------------------------------- running a turn
async def _run(state: ServerState, body: _Sampling, turn: _Turn, max_tokens: int | None,
               request: Request, chat: bool) -> Response:
    renderer = state.renderer
    try:
        stop_ids = renderer.stop_token_ids(body.stop_list()) if renderer else []
    except ValueError as e:
        raise APIError(400, str(e), param="stop") from e
    history_len = len(turn.stored.token_ids) if turn.stored and not turn.full_context else 0
    room = state.max_model_len - history_len - len(turn.prompt_ids)
    if room < 1:
        raise APIError(400, f"the conversation's context ({history_len + len(turn.prompt_ids)} "
                       f"tokens) exceeds max_model_len={state.max_model_len}",
                       code="context_length_exceeded", param="messages")
    if max_tokens is None:
        max_tokens = min(room, 1024)
    elif max_tokens > room:
        raise APIError(400, f"max_tokens={max_tokens} exceeds the room left in the context "
                       f"({room} of max_model_len={state.max_model_len})",
                       code="context_length_exceeded", param="max_tokens")
    try:
        params = _params(body, max_tokens, stop_ids)
    except ValueError as e:  # SamplingParams names the field first in its messages
        field = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param=field if field in _SAMPLING_FIELDS else None) from e
    if turn.cid is not None and (body.keep_alive_s is not None or body.priority is not None):
        cid = turn.cid
        await _engine_call(state, lambda e: e.set_conversation_hints(
            cid, body.priority, body.keep_alive_s))
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    t0 = time.monotonic()
    stream = state.engine.generate(rid, turn.prompt_ids, params, turn.cid,
                                   full_context=turn.full_context)
    try:
        first = await stream.__anext__()
    except ConversationBusyError as e:
        raise APIError(409, str(e), code="conversation_busy") from e
    except ValueError as e:
        await _forget_new(state, turn)
        raise APIError(400, str(e)) from e
    state.metrics.ttft.observe(time.monotonic() - t0)
    ctx = _Ctx(state, body, turn, rid, chat, t0)
    if body.stream:
        return StreamingResponse(ctx.sse(first, stream), media_type="text/event-stream",
                                 headers=_conv_header(turn))
    out = await ctx.collect(first, stream, request)
    if out is None:
        return _error(499, "client closed the request")
    return JSONResponse(ctx.final_body(out), headers=_conv_header(turn))


def _conv_header(turn: _Turn) -> dict[str, str]:
    return {"x-conversation-id": turn.cid} if turn.cid else {}


async def _forget_new(state: ServerState, turn: _Turn) -> None:
    """A new conversation whose first turn failed leaves nothing behind in the engine."""
    if turn.new_conversation and turn.cid is not None:
        cid = turn.cid
        await state.engine.call(
            lambda e: None if e.conversation_history(cid) else e.delete_conversation(cid))


class _Ctx:
    """Formats one turn's stream or response and records the turn when it completes."""

    def __init__(self, state: ServerState, body: _Sampling, turn: _Turn, rid: str, chat: bool,
                 t0: float) -> None:
        self.state, self.body, self.turn, self.rid, self.chat, self.t0 = (
            state, body, turn, rid, chat, t0)
        self.created = int(time.time())
        self.tokens: list[int] = []
        self.sent = ""

    def _decode(self, ids: list[int]) -> str:
        r = self.state.renderer
        return r.decode(ids) if r is not None else ""

    def record(self, out: RequestOutput) -> None:
        """Persist the completed turn (before the client sees its end)."""
        self.state.metrics.latency.observe(time.monotonic() - self.t0)
        turn = self.turn
        if turn.cid is None:
            return
        conv = turn.stored or StoredConversation(turn.cid, turn.tenant)
        text = self._decode(out.output_token_ids)
        if self.chat:
            conv.messages = turn.prev + turn.new + [{"role": "assistant", "content": text}]
        else:
            conv.messages = conv.messages + [{"role": "completion", "content": text}]
        conv.token_ids = out.prompt_token_ids + out.output_token_ids
        if self.body.priority is not None:
            conv.priority = self.body.priority
        if self.body.keep_alive_s is not None:
            conv.keep_alive_s = self.body.keep_alive_s
        conv.turns = conv.turns + [{"context_len": len(out.prompt_token_ids),
                                    "output_len": len(out.output_token_ids)}]
        self.state.store.save_turn(conv)

    def final_body(self, out: RequestOutput) -> dict[str, Any]:
        text = self._decode(out.output_token_ids)
        usage = {"prompt_tokens": len(out.prompt_token_ids),
                 "completion_tokens": len(out.output_token_ids),
                 "total_tokens": len(out.prompt_token_ids) + len(out.output_token_ids)}
        choice: dict[str, Any] = {"index": 0, "finish_reason": out.finish_reason,
                                  "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.state.model_name, "choices": [choice],
                "usage": usage, "conversation_id": self.turn.cid,
                "pensieve": {"cache": out.cache_stats}}

    async def collect(self, first: Any, stream: AsyncIterator[Any],
                      request: Request) -> RequestOutput | None:
        upd = first
        while upd.output is None:
            if await request.is_disconnected():
                await stream.aclose()  # aborts the request; the turn is not recorded
                await _forget_new(self.state, self.turn)
                return None
            upd = await stream.__anext__()
        self.record(upd.output)
        return upd.output  # type: ignore[no-any-return]

    def _chunk(self, delta: str, finish: str | None, first: bool = False,
               extra: dict[str, Any] | None = None) -> str:
        if self.chat:
            d: dict[str, Any] = {"content": delta}
            if first:
                d["role"] = "assistant"
            choice: dict[str, Any] = {"index": 0, "delta": d, "finish_reason": finish,
                                      "logprobs": None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}
            obj = "text_completion"
        body = {"id": self.rid, "object": obj, "created": self.created,
                "model": self.state.model_name, "choices": [choice],
                "conversation_id": self.turn.cid, **(extra or {})}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _delta(self, ids: list[int], final: bool) -> str:
        text = self._decode(ids)
        if not final and text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait
            return ""
        new, self.sent = text[len(self.sent):], text
        return new

    async def sse(self, first: Any, stream: AsyncIterator[Any]) -> AsyncIterator[str]:
        completed = False
        try:
            yield self._chunk("", None, first=True)
            upd = first
            while True:
                if upd.output is not None:
                    out: RequestOutput = upd.output
                    self.record(out)
                    completed = True
                    tail = self._delta(out.output_token_ids, final=True)
                    yield self._chunk(tail, out.finish_reason,
                                      extra={"pensieve": {"cache": out.cache_stats}})
                    opts = self.body.stream_options or {}
                    if opts.get("include_usage"):
                        usage = self.final_body(out)["usage"]
                        payload = {"id": self.rid,
                                   "object": "chat.completion.chunk" if self.chat
                                   else "text_completion",
                                   "created": self.created, "model": self.state.model_name,
                                   "choices": [], "usage": usage,
                                   "conversation_id": self.turn.cid}
                        yield f"data: {json.dumps(payload)}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                self.tokens.append(upd.token)
                delta = self._delta(self.tokens, final=False)
                if delta:
                    yield self._chunk(delta, None)
                upd = await stream.__anext__()
        finally:
            if not completed:  # the client went away: abort, leave the conversation as it was
                await stream.aclose()  # type: ignore[attr-defined]
                await _forget_new(self.state, self.turn)

