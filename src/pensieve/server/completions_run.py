"""Answering one ``/v1/completions`` request once it is authenticated, checked and admitted:
one prompt as one turn, or a batched prompt (a list of strings, or a list of token-id lists,
as OpenAI's API and lm-evaluation-harness send them) as one one-off turn per prompt, run
concurrently (the engine batches them) and answered in order: prompt ``i``'s choice ``j`` is
choice ``i * n + j``, and the usage is their sum.

A batched prompt neither streams nor names a conversation (each would need a stream or a
conversation per prompt): either is a 400 naming the field, as is a batch of more than
:data:`MAX_BATCH_PROMPTS` prompts.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pensieve.server.choices import run_choices
from pensieve.server.completions_echo import check_echo
from pensieve.server.conversation_names import resolve
from pensieve.server.errors import APIError
from pensieve.server.protocol import CompletionRequest, is_batched
from pensieve.server.respond import run_turn
from pensieve.server.state import ServerState
from pensieve.server.turns import completion_turn

MAX_BATCH_PROMPTS = 256
"""Most prompts one batched request may carry."""


async def answer_completion(state: ServerState, body: CompletionRequest, tenant: str,
                            cid: str | None, request: Request) -> Response:
    """The completion (JSON or a stream) of ``body``: one turn, or a batch of them."""
    check_echo(body)
    if is_batched(body.prompt):
        return await _batch(state, body, tenant, cid, request)
    cid, name = await resolve(state, tenant, cid)
    turn = await completion_turn(state, tenant, cid, body.prompt, body.create_conversation,
                                 name)
    return await run_turn(state, body, turn, body.max_tokens, request, chat=False,
                          choices=run_choices)


async def _batch(state: ServerState, body: CompletionRequest, tenant: str, cid: str | None,
                 request: Request) -> Response:
    prompts: list[Any] = list(body.prompt)
    for bad, name in ((body.stream, "stream"), (cid is not None, "conversation_id"),
                      (body.create_conversation, "create_conversation")):
        if bad:
            raise APIError(400, f"a batched prompt cannot use {name}: send one prompt per "
                           "request for that", param=name, code="unsupported_parameter")
    if len(prompts) > MAX_BATCH_PROMPTS:
        raise APIError(400, f"at most {MAX_BATCH_PROMPTS} prompts per request, got "
                       f"{len(prompts)}", param="prompt")

    async def one(i: int) -> dict[str, Any]:
        sub = body.model_copy(update={"prompt": prompts[i]})
        try:
            turn = await completion_turn(state, tenant, None, prompts[i], False)
            answer = await run_turn(state, sub, turn, body.max_tokens, request, chat=False,
                                    choices=run_choices)
        except APIError as e:
            if e.param == "prompt":
                e.param = f"prompt.{i}"
            raise
        if answer.status_code != 200:
            raise APIError(answer.status_code, f"prompt {i}: "
                           f"{json.loads(bytes(answer.body))['error']['message']}",
                           param=f"prompt.{i}")
        data: dict[str, Any] = json.loads(bytes(answer.body))
        return data

    results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return JSONResponse(_merged(results, body.n))


def _merged(results: list[dict[str, Any]], n: int) -> dict[str, Any]:
    out = dict(results[0])
    out["choices"] = [{**c, "index": i * n + c["index"]}
                      for i, r in enumerate(results) for c in r["choices"]]
    usage = {k: sum(r["usage"][k] for r in results)
             for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    usage["prompt_tokens_details"] = {"cached_tokens": sum(
        r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results)}
    out["usage"] = usage
    out["pensieve"] = {"cache": {k: sum(r["pensieve"]["cache"].get(k, 0) for r in results)
                                 for k in results[0]["pensieve"]["cache"]},
                       "stored": all(r["pensieve"]["stored"] for r in results)}
    return out
