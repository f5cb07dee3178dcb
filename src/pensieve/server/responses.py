"""``POST /v1/responses`` (OpenAI's Responses API), ``GET`` and ``DELETE
/v1/responses/{id}``: a Responses request answered as a chat turn of a Pensieve conversation.

A response is a turn. Its input items become chat messages (:mod:`.responses_items`), after a
system message of its ``instructions``; the chat turn runs (:func:`.chat_run.answer_chat`),
and its answer comes back as output items (JSON, or Responses' stream events). A stored
response (``store``, the default) remembers its conversation, its instructions and the
conversation's messages after it. ``previous_response_id`` continues from there:

- when that response is still the conversation's last turn and the instructions are the same,
  the new items continue the conversation itself (its history and KV, not re-sent);
- otherwise (a branch from an earlier response, or other instructions, which OpenAI does not
  carry over) the remembered messages and the new items form a new conversation, whose
  history match (:func:`.turns.chat_turn`) still finds stored KV where it can.

Stored responses live in the server's memory (the newest :data:`MAX_STORED_RESPONSES`) and
belong to the API key that created them; the conversations they name are stored as any.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from pensieve.server.chat_run import answer_chat
from pensieve.server.errors import APIError
from pensieve.server.protocol import ChatCompletionRequest, _Sampling
from pensieve.server.respond import sse_data
from pensieve.server.responses_items import (
    PASSED_TO_CHAT,
    ResponsesRequest,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    input_messages,
    new_id,
    output_items,
    response_object,
)
from pensieve.server.responses_stream import stream_events
from pensieve.server.state import ServerState
from pensieve.server.turns import off_loop

MAX_STORED_RESPONSES = 10_000
"""Stored responses kept in memory (the oldest forgotten first)."""


@dataclass
class StoredResponse:
    tenant: str
    cid: str | None
    """The conversation the response's turn ran in."""
    instructions: str | None
    history: list[dict[str, Any]]
    """The conversation's messages after the response, without the instructions' system
    message (canonical, as the store keeps them)."""
    body: dict[str, Any]
    """The response object, for ``GET``."""


class ResponseStore:
    """The stored responses of every tenant, newest last; each tenant sees only its own."""

    def __init__(self, limit: int = MAX_STORED_RESPONSES) -> None:
        self.limit = limit
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, rid: str, rec: StoredResponse) -> None:
        self._items[rid] = rec
        while len(self._items) > self.limit:
            self._items.popitem(last=False)

    def get(self, rid: str, tenant: str, param: str = "response_id") -> StoredResponse:
        rec = self._items.get(rid)
        if rec is None or rec.tenant != tenant:
            raise APIError(404, f"response {rid!r} not found", param=param,
                           code="response_not_found")
        return rec

    def delete(self, rid: str, tenant: str) -> None:
        self.get(rid, tenant)
        del self._items[rid]


@dataclass
class _Plan:
    """How a Responses request runs as a chat turn."""

    chat: ChatCompletionRequest
    cid: str | None
    """The conversation it continues (None: a new one, or the one its history matches)."""
    system: list[dict[str, Any]]
    """The instructions' system message (or nothing)."""


def _check_own_fields(body: ResponsesRequest) -> None:
    if body.include:
        raise APIError(400, f"include {body.include!r} is not supported by this server",
                       param="include", code="unsupported_parameter")
    if body.reasoning and any(v is not None for v in body.reasoning.values()):
        raise APIError(400, "reasoning is not supported by this server (the model's own "
                       "thinking is not steered)", param="reasoning",
                       code="unsupported_parameter")


def _chat_body(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request of ``body`` with ``messages``; a 400 naming a field it cannot take."""
    d: dict[str, Any] = {"model": body.model, "messages": messages, "stream": body.stream,
                         "max_tokens": body.max_output_tokens,
                         "response_format": chat_response_format(body.text)}
    if body.stream:
        d["stream_options"] = {"include_usage": True}
    verbosity = (body.text or {}).get("verbosity")
    if verbosity is not None:
        d["verbosity"] = verbosity  # recorded, as on chat (:mod:`.vllm_fields`)
    for name in ("temperature", "top_p"):
        if getattr(body, name) is not None:
            d[name] = getattr(body, name)
    tools = chat_tools(body.tools)
    if tools:
        d.update(tools=tools, tool_choice=chat_tool_choice(body.tool_choice),
                 parallel_tool_calls=body.parallel_tool_calls)
    elif body.tool_choice not in (None, "none", "auto"):
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    for name, value in (body.model_extra or {}).items():
        if name not in PASSED_TO_CHAT:
            raise APIError(400, f"unknown field {name!r}: this server does not implement it "
                           "(docs/api.md lists the fields)", param=name,
                           code="unknown_parameter")
        d[name] = value
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in d.items()
                                                     if v is not None})
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        raise APIError(400, f"{loc}: {first.get('msg')}", param=loc or None) from None


async def _plan(state: ServerState, records: ResponseStore, body: ResponsesRequest,
                tenant: str) -> _Plan:
    new = input_messages(body.input)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if body.previous_response_id is None:
        return _Plan(_chat_body(body, system + new), None, system)
    rec = records.get(body.previous_response_id, tenant, param="previous_response_id")
    cid = rec.cid
    conv = await off_loop(state, lambda: state.store.get(cid)) if cid else None
    if (conv is not None and conv.tenant == tenant and rec.instructions == body.instructions
            and conv.messages == system + rec.history):
        return _Plan(_chat_body(body, new), cid, system)
    return _Plan(_chat_body(body, system + rec.history + new), None, system)


async def _remember(state: ServerState, records: ResponseStore, body: ResponsesRequest,
                    tenant: str, plan: _Plan, obj: dict[str, Any]) -> None:
    """Store the response (with ``store``) for ``previous_response_id`` and ``GET``."""
    if not body.store or obj["status"] == "failed":
        return
    cid = obj.get("conversation_id")
    conv = await off_loop(state, lambda: state.store.get(cid)) if cid else None
    history = conv.messages[len(plan.system):] if conv is not None else []
    records.put(obj["id"], StoredResponse(tenant, cid if conv is not None else None,
                                          body.instructions, history, obj))


def _finished(body: ResponsesRequest, rid: str, data: dict[str, Any]) -> dict[str, Any]:
    """The response object of a finished chat completion ``data``."""
    choice = data["choices"][0]
    obj = response_object(body, rid, data["model"], "completed",
                          output_items(choice["message"]), choice["finish_reason"],
                          data["usage"])
    obj["conversation_id"], obj["pensieve"] = data.get("conversation_id"), data.get("pensieve")
    return obj


def add_response_routes(app: FastAPI, state: ServerState,
                        tenant_of: Callable[[Request], str],
                        check_request: Callable[[_Sampling], None],
                        admitted: Callable[[Callable[[], Awaitable[Response]]],
                                           Awaitable[Response]]) -> None:
    """The routes; ``tenant_of``, ``check_request`` and ``admitted`` are the app's API-key
    check, request check and admission control."""
    records = ResponseStore()

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        tenant = tenant_of(request)
        _check_own_fields(body)
        plan = await _plan(state, records, body, tenant)
        check_request(plan.chat)

        async def go() -> Response:
            rid = new_id("resp_")
            answer = await answer_chat(state, plan.chat, tenant, plan.cid, request)
            headers = {k: v for k, v in answer.headers.items()
                       if k in ("x-conversation-id", "x-pensieve-stored")}
            if isinstance(answer, StreamingResponse):
                async def remember(obj: dict[str, Any]) -> None:
                    await _remember(state, records, body, tenant, plan, obj)

                events = stream_events(body, rid, body.model or state.model_name,
                                       answer.body_iterator, remember)
                return StreamingResponse(_sse(events), media_type="text/event-stream",
                                         headers=headers)
            if answer.status_code != 200:
                return answer
            obj = _finished(body, rid, json.loads(bytes(answer.body)))
            await _remember(state, records, body, tenant, plan, obj)
            return JSONResponse(obj, headers=headers)

        return await admitted(go)

    @app.get("/v1/responses/{rid}")
    async def get_response(rid: str, request: Request) -> dict[str, Any]:
        return records.get(rid, tenant_of(request)).body

    @app.delete("/v1/responses/{rid}")
    async def delete_response(rid: str, request: Request) -> dict[str, Any]:
        records.delete(rid, tenant_of(request))
        return {"id": rid, "object": "response.deleted", "deleted": True}


async def _sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    async for ev in events:
        yield f"event: {ev['type']}\n" + sse_data(ev)
