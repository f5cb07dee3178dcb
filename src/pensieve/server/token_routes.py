"""``/tokenize``, ``/detokenize`` and ``/version``, in vLLM's request and response shapes.

``/tokenize`` takes a completion ``prompt`` (``add_special_tokens`` default true) or chat
``messages`` (rendered with the chat template, ``add_generation_prompt`` default true, as
vLLM; ``add_special_tokens`` default false) and answers ``{count, max_model_len, tokens}``.
``/detokenize`` takes ``tokens`` and answers ``{prompt}``. Both need the API key when one is
set, and run the tokenizer in the server's thread pool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

import pensieve
from pensieve.server.errors import APIError
from pensieve.server.fields import check_message_fields
from pensieve.server.protocol import ChatMessage
from pensieve.server.state import ServerState
from pensieve.server.turns import off_loop


class TokenizeRequest(BaseModel):
    """vLLM's ``CompletionTokenizeRequest`` or ``ChatTokenizeRequest`` (one of ``prompt`` and
    ``messages``)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    """Default: true for ``prompt``, false for ``messages`` (the template adds them)."""
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int] = Field(min_length=0)


def _tokenize(state: ServerState, body: TokenizeRequest) -> list[int]:
    renderer = state.renderer
    if renderer is None:
        raise APIError(400, "this model has no tokenizer", param="prompt" if body.prompt
                       is not None else "messages", code="no_tokenizer")
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    try:
        if body.prompt is not None:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            body.prompt.encode("utf-8")
            return list(renderer.tokenizer.encode(body.prompt, add_special_tokens=add))
        assert body.messages is not None
        check_message_fields(body.messages)
        ids = renderer.render([m.as_dict() for m in body.messages],
                              add_generation_prompt=body.add_generation_prompt,
                              template_kwargs=body.chat_template_kwargs)
    except (ValueError, TypeError) as e:  # bad text, a template that refuses the messages
        raise APIError(400, str(e), param="messages" if body.messages else "prompt") from e
    if body.add_special_tokens:
        bos = getattr(renderer.tokenizer, "bos_token_id", None)
        if bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
    return ids


def _detokenize(state: ServerState, tokens: list[int]) -> str:
    renderer = state.renderer
    if renderer is None:
        raise APIError(400, "this model has no tokenizer", param="tokens", code="no_tokenizer")
    vocab = len(renderer.tokenizer)
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", param="tokens")
    return str(renderer.tokenizer.decode(tokens))


def add_token_routes(app: FastAPI, state: ServerState,
                     check_model: Callable[[str | None], None],
                     tenant: Callable[[ServerState, Request], str]) -> None:
    """``POST /tokenize``, ``POST /detokenize`` and ``GET /version``."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        tenant(state, request)
        check_model(body.model)
        ids = await off_loop(state, lambda: _tokenize(state, body))
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
        tenant(state, request)
        check_model(body.model)
        text = await off_loop(state, lambda: _detokenize(state, body.tokens))
        return {"prompt": text}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pensieve.__version__}
