"""Which conversation a request continues, and the tokens its turn feeds the model.

A chat turn's context is always the chat template of *all* its messages (the conversation's
stored ones and the new ones) with the generation prompt; the engine keeps the history's
common prefix with it (:meth:`AsyncEngine.generate`, ``full_context``). A completions turn of a
conversation appends its token ids to the history. Blocking work (template rendering,
tokenization) runs in the server's thread pool, never on the event loop.

Retries. Behind the replicas' ingress every request carries a key (:data:`request_key`), the
same on the ingress's retries, and the turn it completes is stored with it. A retry whose
key wrote its conversation's last turn is the same request again after its first replica
stored the turn and died before answering: it redoes that turn (the conversation as it was
before it, under the same id), so the stored turn is the one the client receives, instead of
the re-sent history finding no conversation (the stored one already holds the turn) and
starting a new one without the earlier turns.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from jinja2.exceptions import TemplateError

from pensieve.core.scheduler import ConversationBusyError
from pensieve.server import engine_ops
from pensieve.server.engine_loop import EngineRequestError
from pensieve.server.errors import APIError
from pensieve.server.state import ServerState
from pensieve.server.store_sqlite import CorruptConversationError, StoredConversation

T = TypeVar("T")

request_key: ContextVar[str] = ContextVar("pensieve_request_key", default="")
"""The key of the request being served ("" when none: only the replicas' ingress gives one,
:func:`pensieve.replicas.asgi.with_request_key` sets it)."""


@dataclass
class Turn:
    tenant: str
    cid: str | None
    """The conversation (None: a one-off completion)."""
    stored: StoredConversation | None
    """Its stored state before this turn, which the turn's write replaces (a new conversation:
    an empty one, not stored yet; None: no conversation)."""
    prev: list[dict[str, Any]]
    new: list[dict[str, Any]]
    prompt_ids: list[int]
    """The new turn's tokens (the engine prepends the conversation's history), or with
    ``full_context`` the turn's whole context."""
    new_conversation: bool
    full_context: bool = False
    engine_cid: str | None = None
    """The engine conversation that holds its KV (None: ``cid``; :mod:`.engine_ids`)."""

    @property
    def kv_id(self) -> str | None:
        """The conversation's id in the engine."""
        return self.engine_cid or self.cid

    @property
    def context_ids(self) -> list[int]:
        """Every token of the turn's context."""
        if self.full_context or self.stored is None:
            return self.prompt_ids
        return self.stored.token_ids + self.prompt_ids


async def off_loop(state: ServerState, fn: Callable[[], T]) -> T:
    """Run ``fn()`` in the server's thread pool (rendering, tokenizing)."""
    return await asyncio.get_running_loop().run_in_executor(state.pool, fn)


def new_conversation_id() -> str:
    """An unguessable id (it is also the conversation's handle, so it must not be enumerable)."""
    return "conv-" + secrets.token_urlsafe(18)


def owned(state: ServerState, cid: str, tenant: str) -> StoredConversation:
    """The tenant's conversation ``cid`` (a 404 when it is another tenant's or none; its
    owner gets the 500 of a corrupt one)."""
    try:
        conv = state.store.get(cid)
    except CorruptConversationError as e:
        if e.tenant and e.tenant != tenant:
            raise APIError(404, f"conversation {cid!r} not found",
                           code="conversation_not_found", param="conversation_id") from None
        raise
    if conv is None or conv.tenant != tenant:  # another tenant's id looks like an unknown one
        raise APIError(404, f"conversation {cid!r} not found", code="conversation_not_found",
                       param="conversation_id")
    return conv


async def engine_call(state: ServerState, fn: Any, *args: Any) -> Any:
    try:
        return await state.engine.call(fn, *args)
    except EngineRequestError as e:  # the engine (its process) is gone
        raise APIError(500, f"the engine failed on this request: {e}", "server_error",
                       code="engine_error") from e
    except ConversationBusyError as e:
        raise APIError(409, str(e), code="conversation_busy", param="conversation_id") from e
    except ValueError as e:
        raise APIError(400, str(e)) from e


async def restore(state: ServerState, stored: StoredConversation,
                  engine_cid: str | None = None) -> None:
    """Make the engine's history of the conversation (its engine conversation
    ``engine_cid``, by default the one :mod:`.engine_ids` gives it) the stored one: after a
    restart (history, no KV), or when another replica continued it (or redid its last turn)
    since this engine last served it (the KV of the common prefix kept)."""
    eid = engine_cid or state.engine_ids.of(stored.id)
    await engine_call(state, engine_ops.restore, eid, stored.token_ids, stored.priority,
                      stored.keep_alive_s, stored.tenant)


def _retried(state: ServerState, tenant: str, cid: str | None) -> StoredConversation | None:
    """The conversation whose last turn this request (its key) already wrote, if any, and
    ``cid``'s when the request names one."""
    key = request_key.get()
    found = state.store.find_by_request(tenant, key) if key else None
    conv = state.store.get(found) if found is not None else None
    if conv is None or not conv.turns or (cid is not None and conv.id != cid):
        return None
    return conv


def _before_last_turn(conv: StoredConversation, messages: list[dict[str, Any]],
                      token_ids: list[int]) -> StoredConversation:
    """``conv`` as it was before its last turn (its version kept: the redone turn's write
    replaces the row it was read from)."""
    return dataclasses.replace(conv, messages=messages, token_ids=token_ids,
                               turns=conv.turns[:-1])


def _chat_retry(state: ServerState, tenant: str, cid: str | None, msgs: list[dict[str, Any]]
                ) -> tuple[StoredConversation, list[dict[str, Any]], list[dict[str, Any]]] | None:
    """(the conversation before its last turn, prev, new) when this request wrote that turn
    (its messages, then one answer)."""
    conv = _retried(state, tenant, cid)
    if conv is None or not msgs:
        return None
    asked = conv.messages[:-1]  # the last turn's answer dropped
    if asked == msgs:  # the whole history, then the turn's new messages
        k = max((i + 1 for i, m in enumerate(msgs) if m["role"] == "assistant"), default=0)
        prev = msgs[:k]
    elif cid is not None and asked[len(asked) - len(msgs):] == msgs:  # the new ones only
        prev = asked[:len(asked) - len(msgs)]
    else:
        return None
    # the redone turn's context: its tokens before the answer
    before = conv.token_ids[:conv.turns[-1]["context_len"]]
    return _before_last_turn(conv, prev, before), prev, asked[len(prev):]


def _chat_history(state: ServerState, tenant: str, cid: str | None,
                  msgs: list[dict[str, Any]]
                  ) -> tuple[StoredConversation, list[dict[str, Any]], list[dict[str, Any]]] | None:
    """(the stored conversation, prev, new): the one ``cid`` names, or the longest prefix of
    ``msgs`` that ends with an answer and equals a stored conversation of the tenant. A
    request that names its conversation and still sends the whole history (the stored
    messages, then new ones) continues it with the new ones: the history is not doubled."""
    if cid is not None:
        stored = owned(state, cid, tenant)
        n = len(stored.messages)
        new = msgs[n:] if n and msgs[:n] == stored.messages else msgs
        return stored, stored.messages, new
    for k in range(len(msgs) - 1, 0, -1):
        if msgs[k - 1]["role"] != "assistant":
            continue
        found = state.store.find_by_messages(tenant, msgs[:k])
        conv = state.store.get(found) if found is not None else None
        if conv is not None:
            return conv, msgs[:k], msgs[k:]
    return None


async def chat_turn(state: ServerState, tenant: str, cid: str | None,
                    msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None,
                    name: str | None = None, options: dict[str, Any] | None = None) -> Turn:
    """The turn of a chat request: the conversation it names or whose history it re-sends
    (the longest prefix of its messages that ends with an answer and equals a stored
    conversation of the tenant: a new conversation over that one's KV, :mod:`.engine_ids`),
    or a new one; a retry of a stored turn redoes it. ``tools`` (OpenAI's function tools) go
    into the rendering (:mod:`.tools`). ``name``: the id a new conversation gets (a client's
    name for its first turn, :mod:`.conversation_names`), instead of a fresh one; ``options``:
    the request's own ``apply_chat_template`` arguments (:func:`.chat_run.template_options`)."""
    found = _chat_retry(state, tenant, cid, msgs)
    matched = found is None and cid is None  # a history found is a cache hit, not an identity
    found = found or _chat_history(state, tenant, cid, msgs)
    if found is None:
        ids = await off_loop(state, lambda: render(state, msgs, tools, template_kwargs,
                                                   options))
        cid = name or new_conversation_id()
        return Turn(tenant, cid, _new(cid, tenant), [], msgs, ids, new_conversation=True,
                    full_context=True)
    stored, prev, new = found
    stored.request_key = request_key.get()
    if not new:
        raise APIError(400, "no new message after the conversation's last answer",
                       param="messages")
    if any(m.get("role") == "completion" for m in prev):
        raise APIError(400, f"conversation {stored.id!r} was started on /v1/completions: "
                       "continue it there", param="conversation_id")
    ids = await off_loop(state, lambda: render(state, prev + new, tools, template_kwargs,
                                               options))
    if matched:
        return await _take_over(state, tenant, stored, prev, new, ids, name)
    await restore(state, stored)
    return Turn(tenant, stored.id, stored, prev, new, ids, new_conversation=False,
                full_context=True, engine_cid=state.engine_ids.of(stored.id))


async def _take_over(state: ServerState, tenant: str, matched: StoredConversation,
                     prev: list[dict[str, Any]], new: list[dict[str, Any]], ids: list[int],
                     name: str | None = None) -> Turn:
    """A new conversation whose history is ``matched``'s, over its engine conversation (its
    KV) unless a turn of that one runs: then over an engine conversation of its own."""
    cid = name or new_conversation_id()
    conv = dataclasses.replace(matched, id=cid, tenant=tenant, created=0.0, updated=0.0,
                               request_key=request_key.get(), version=0)
    eid = state.engine_ids.take_over(matched.id, cid)
    try:
        await restore(state, conv, eid)
    except APIError as e:
        state.engine_ids.give_back(cid)
        if e.code != "conversation_busy":
            raise
        eid = cid
        await restore(state, conv, eid)
    return Turn(tenant, cid, conv, prev, new, ids, new_conversation=True, full_context=True,
                engine_cid=eid)


async def completion_turn(state: ServerState, tenant: str, cid: str | None, prompt: Any,
                          create_conversation: bool, name: str | None = None) -> Turn:
    if isinstance(prompt, str):
        renderer = state.renderer
        if renderer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids",
                           param="prompt")
        try:
            ids = await off_loop(state, lambda: renderer.encode(prompt))
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from e
        if not ids:
            raise APIError(400, "the prompt encodes to no tokens", param="prompt")
    else:
        ids = list(prompt)
    stored = _completion_retry(state, tenant, cid, ids)
    if stored is None and cid is not None:
        stored = owned(state, cid, tenant)
        stored.request_key = request_key.get()
    if stored is not None:
        await restore(state, stored)
        return Turn(tenant, stored.id, stored, [], [], ids, new_conversation=False,
                    engine_cid=state.engine_ids.of(stored.id))
    if create_conversation or name:
        cid = name or new_conversation_id()
        return Turn(tenant, cid, _new(cid, tenant), [], [], ids, new_conversation=True)
    return Turn(tenant, None, None, [], [], ids, new_conversation=False)


def _new(cid: str, tenant: str) -> StoredConversation:
    return StoredConversation(cid, tenant, request_key=request_key.get())


def _completion_retry(state: ServerState, tenant: str, cid: str | None, ids: list[int]
                      ) -> StoredConversation | None:
    """The conversation before its last turn when this request wrote that turn (a completion
    of the prompt ``ids``)."""
    conv = _retried(state, tenant, cid)
    if conv is None or not conv.messages or conv.messages[-1].get("role") != "completion":
        return None
    end = conv.turns[-1]["context_len"]
    start = end - len(ids)
    if start < 0 or conv.token_ids[start:end] != ids:
        return None
    return _before_last_turn(conv, conv.messages[:-1], conv.token_ids[:start])


def render(state: ServerState, messages: list[dict[str, Any]],
           tools: list[dict[str, Any]] | None = None,
           template_kwargs: dict[str, Any] | None = None,
           options: dict[str, Any] | None = None) -> list[int]:
    """The chat template's tokens for ``messages`` and the generation prompt: exactly what
    the model is fed (the engine keeps only the history's common prefix with it)."""
    assert state.renderer is not None
    try:
        return state.renderer.render(messages, add_generation_prompt=True, tools=tools,
                                     template_kwargs=template_kwargs, options=options)
    except TemplateError as e:  # e.g. a template that demands alternating roles
        raise APIError(400, f"the chat template refused the messages: {e}",
                       param="messages") from e
    except ValueError as e:  # a reserved template variable, or special-token text the
        # template's own text cannot be told from
        param = "chat_template_kwargs" if "chat_template_kwargs" in str(e) else "messages"
        raise APIError(400, str(e), param=param) from e
    except Exception as e:  # noqa: BLE001 - the template on the client's kwargs and messages
        raise APIError(400, f"the chat template failed on the request: {type(e).__name__}: "
                       f"{e}", param="chat_template_kwargs" if template_kwargs else "messages"
                       ) from e
