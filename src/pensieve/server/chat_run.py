"""Answering one chat request once it is authenticated, checked and admitted: its messages in
canonical form, its constraint compiled, its turn found (:func:`.turns.chat_turn`) and run.
``/v1/chat/completions`` and ``/v1/responses`` (which translates its items into chat
messages, :mod:`.responses`) both answer through here."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from pensieve.server.choices import run_choices
from pensieve.server.conversation_names import resolve
from pensieve.server.errors import APIError
from pensieve.server.protocol import ChatCompletionRequest
from pensieve.server.respond import run_turn
from pensieve.server.state import ServerState
from pensieve.server.structured import compile_constraint, constraint
from pensieve.server.turns import chat_turn, off_loop


async def answer_chat(state: ServerState, body: ChatCompletionRequest, tenant: str,
                      cid: str | None, request: Request) -> Response:
    """The chat completion (JSON or a stream) of ``body`` in conversation ``cid`` (None: a
    new one, or the stored one whose history the messages re-send)."""
    if state.renderer is None:
        raise APIError(400, "this model has no tokenizer: use /v1/completions with token "
                       "ids", param="messages", code="no_tokenizer")
    try:
        msgs = await off_loop(state, lambda: [m.canonical() for m in body.messages])
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from e
    tools = [t.as_dict() for t in body.tools or []] or None
    wanted = await off_loop(state, lambda: constraint(state, body))
    await compile_constraint(state, wanted)
    cid, name = await resolve(state, tenant, cid)
    turn = await chat_turn(state, tenant, cid, msgs, tools, body.chat_template_kwargs, name)
    max_tokens = body.max_completion_tokens or body.max_tokens
    return await run_turn(state, body, turn, max_tokens, request, chat=True,
                          choices=run_choices, constraint=wanted)
