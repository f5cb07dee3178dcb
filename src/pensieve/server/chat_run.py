"""Answering one chat request once it is authenticated, checked and admitted: its messages in
canonical form, its constraint compiled, its turn found (:func:`.turns.chat_turn`) and run.
``/v1/chat/completions`` and ``/v1/responses`` (which translates its items into chat
messages, :mod:`.responses`) both answer through here."""

from __future__ import annotations

from typing import Any

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
    turn = await chat_turn(state, tenant, cid, msgs, tools, body.chat_template_kwargs, name,
                           template_options(body))
    max_tokens = body.max_completion_tokens or body.max_tokens
    return await run_turn(state, body, turn, max_tokens, request, chat=True,
                          choices=run_choices, constraint=wanted)


def template_options(body: ChatCompletionRequest) -> dict[str, Any] | None:
    """vLLM's rendering fields as ``apply_chat_template`` arguments (None: the defaults).
    ``continue_final_message`` needs the last message to be an assistant's, and excludes
    ``add_generation_prompt`` (as vLLM: a 400 naming the field)."""
    if body.continue_final_message:
        if body.add_generation_prompt and "add_generation_prompt" in body.model_fields_set:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both "
                           "be true", param="continue_final_message")
        if body.messages[-1].role != "assistant":
            raise APIError(400, "continue_final_message needs the last message to be an "
                           "assistant's", param="continue_final_message")
    opts: dict[str, Any] = {}
    if not body.add_generation_prompt or body.continue_final_message:
        opts["add_generation_prompt"] = False
    if body.continue_final_message:
        opts["continue_final_message"] = True
    if body.documents is not None:
        opts["documents"] = body.documents
    return opts or None
