"""Which conversation a request continues, and the tokens its turn feeds the model.

A chat turn's context is always the chat template of *all* its messages (the conversation's
stored ones and the new ones) with the generation prompt; the engine keeps the history's
common prefix with it (:meth:`AsyncEngine.generate`, ``full_context``). A completions turn of a
conversation appends its token ids to the history. Blocking work (template rendering,
tokenization) runs in the server's thread pool, never on the event loop.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from jinja2.exceptions import TemplateError

from pensieve.core.scheduler import ConversationBusyError
from pensieve.server.errors import APIError
from pensieve.server.state import ServerState
from pensieve.server.store import StoredConversation

T = TypeVar("T")


@dataclass
class Turn:
    tenant: str
    cid: str | None
    """The conversation (None: a one-off completion)."""
    stored: StoredConversation | None
    """Its stored state before this turn (None: a new conversation or none)."""
    prev: list[dict[str, Any]]
    new: list[dict[str, Any]]
    prompt_ids: list[int]
    """The new turn's tokens (the engine prepends the conversation's history), or with
    ``full_context`` the turn's whole context."""
    new_conversation: bool
    full_context: bool = False

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
    conv = state.store.get(cid)
    if conv is None or conv.tenant != tenant:  # another tenant's id looks like an unknown one
        raise APIError(404, f"conversation {cid!r} not found", code="conversation_not_found",
                       param="conversation_id")
    return conv


async def engine_call(state: ServerState, fn: Any) -> Any:
    try:
        return await state.engine.call(fn)
    except ConversationBusyError as e:
        raise APIError(409, str(e), code="conversation_busy") from e
    except ValueError as e:
        raise APIError(400, str(e)) from e


async def restore(state: ServerState, stored: StoredConversation) -> None:
    """Make sure the engine knows the conversation (after a restart: history, no KV)."""

    def fn(eng: Any) -> None:
        eng.restore_conversation(stored.id, stored.token_ids)
        eng.set_conversation_hints(stored.id, stored.priority, stored.keep_alive_s)

    await engine_call(state, fn)


async def chat_turn(state: ServerState, tenant: str, cid: str | None,
                    msgs: list[dict[str, Any]]) -> Turn:
    """The turn of a chat request: the conversation it names or whose history it re-sends
    (the longest prefix of its messages that ends with an answer and equals a stored
    conversation of the tenant), or a new one."""
    stored: StoredConversation | None = None
    prev: list[dict[str, Any]] = []
    new = msgs
    if cid is not None:
        stored = owned(state, cid, tenant)
        prev = stored.messages
    else:
        for k in range(len(msgs) - 1, 0, -1):
            if msgs[k - 1]["role"] != "assistant":
                continue
            found = state.store.find_by_messages(tenant, msgs[:k])
            if found is not None:
                cid, stored, prev, new = found, state.store.get(found), msgs[:k], msgs[k:]
                break
    if stored is None:
        ids = await off_loop(state, lambda: render(state, new))
        return Turn(tenant, new_conversation_id(), None, [], new, ids, new_conversation=True,
                    full_context=True)
    if not new:
        raise APIError(400, "no new message after the conversation's last answer",
                       param="messages")
    if any(m.get("role") == "completion" for m in prev):
        raise APIError(400, f"conversation {stored.id!r} was started on /v1/completions: "
                       "continue it there", param="conversation_id")
    ids = await off_loop(state, lambda: render(state, prev + new))
    await restore(state, stored)
    return Turn(tenant, stored.id, stored, prev, new, ids, new_conversation=False,
                full_context=True)


async def completion_turn(state: ServerState, tenant: str, cid: str | None, prompt: Any,
                          create_conversation: bool) -> Turn:
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
    if cid is not None:
        stored = owned(state, cid, tenant)
        await restore(state, stored)
        return Turn(tenant, cid, stored, [], [], ids, new_conversation=False)
    if create_conversation:
        return Turn(tenant, new_conversation_id(), None, [], [], ids, new_conversation=True)
    return Turn(tenant, None, None, [], [], ids, new_conversation=False)


def render(state: ServerState, messages: list[dict[str, Any]]) -> list[int]:
    """The chat template's tokens for ``messages`` and the generation prompt: exactly what
    the model is fed (the engine keeps only the history's common prefix with it)."""
    assert state.renderer is not None
    try:
        return state.renderer.render(messages, add_generation_prompt=True)
    except TemplateError as e:  # e.g. a template that demands alternating roles
        raise APIError(400, f"the chat template refused the messages: {e}",
                       param="messages") from e
