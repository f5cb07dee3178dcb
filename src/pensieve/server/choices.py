"""``n`` > 1: several choices for one prompt, sharing its KV.

The choices run one after another on the turn's conversation (a one-off completion gets a
conversation for the run only), each with the turn's whole context. The first computes the
prompt; each later one finds the conversation's history to be the prompt plus the previous
choice's answer, keeps the prompt's KV and recomputes only the prompt's last token (its
logits are needed) and nothing of the answer (:func:`engine_ops.rebase`)::

    choice 1:  [prompt.............][answer 1]       computes the prompt
    choice 2:  [prompt............][.][answer 2]     recomputes 1 token
    choice 0:  [prompt............][.][answer 0]     runs last: the conversation continues
                                                     with choice 0, whose KV stays

Choice 0 runs last, so the conversation (stored and in the engine) continues with it. A
seeded request seeds choice i with ``seed + i``. The cost: the choices' decodes are serial
(n times one choice's decode time), not batched together.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pensieve.core.sampling_params import SamplingParams
from pensieve.server import engine_ops
from pensieve.server.engine_loop import EngineRequestError
from pensieve.server.errors import APIError, error_response
from pensieve.server.protocol import _Sampling
from pensieve.server.respond import Result, TurnOutput, error_event, start
from pensieve.server.state import ServerState
from pensieve.server.turns import Turn, new_conversation_id


class Choices:
    """The choices of one request: their order, outputs and combined answer."""

    def __init__(self, state: ServerState, body: _Sampling, turn: Turn, params: SamplingParams,
                 chat: bool, stops: list[str], rid: str) -> None:
        self.state, self.body, self.turn, self.params, self.chat, self.stops, self.rid = (
            state, body, turn, params, chat, stops, rid)
        self.cid = turn.kv_id or "tmp-" + new_conversation_id()
        """The conversation the choices share (a temporary one for a one-off completion)."""
        self.order = list(range(1, body.n)) + [0]
        self.outs: dict[int, TurnOutput] = {}
        self.t0 = time.monotonic()

    async def start(self, i: int) -> tuple[TurnOutput, Any, Any]:
        """Submit choice ``i``: (its output, first update, stream)."""
        p = self.params
        if p.seed is not None:
            p = dataclasses.replace(p, seed=(p.seed + i) % 2**63)
        rid = f"{self.rid}-{i}"
        first, stream = await start(self.state, self.turn, rid, self.turn.context_ids, p,
                                    self.cid, True, self.body.cache_salt)
        if not self.outs:
            self.state.metrics.ttft.observe(time.monotonic() - self.t0)
        out = TurnOutput(self.state, self.body, self.turn, rid, self.chat, self.t0, self.stops,
                         index=i, record=i == 0)
        out.rid = self.rid  # the chunks and the answer carry the request's id
        self.outs[i] = out
        return out, first, stream

    async def close(self) -> None:
        """Drop the temporary conversation of a one-off completion."""
        if self.turn.cid is None:
            try:
                await self.state.engine.call(engine_ops.drop_conversation, self.cid)
            except (EngineRequestError, ValueError):
                pass  # the engine is gone (and the conversation with it), or it is busy

    def usage(self) -> dict[str, Any]:
        """The prompt once, the completion tokens of all choices."""
        results = [o.result for o in self.outs.values() if o.result is not None]
        n_in = len(self.turn.context_ids)
        n_out = sum(len(r.output_ids) for r in results)
        first = self.outs[self.order[0]].result
        cached = self.outs[self.order[0]].usage(first)["prompt_tokens_details"] if first else {}
        return {"prompt_tokens": n_in, "completion_tokens": n_out,
                "total_tokens": n_in + n_out, "prompt_tokens_details": cached}

    def cache(self) -> dict[str, int]:
        """The cache counters of all choices, summed."""
        total: dict[str, int] = {}
        for o in self.outs.values():
            for k, v in (o.result.cache if o.result else {}).items():
                total[k] = total.get(k, 0) + v
        return total


async def run_choices(state: ServerState, body: _Sampling, turn: Turn, params: SamplingParams,
                      request: Request, chat: bool, stops: list[str], rid: str) -> Response:
    """Answer with ``body.n`` choices (JSON or events), choice 0 continuing the conversation."""
    ch = Choices(state, body, turn, params, chat, stops, rid)
    headers = {"x-conversation-id": turn.cid} if turn.cid else {}
    try:
        first = await ch.start(ch.order[0])
    except BaseException:
        await ch.close()
        raise
    if body.stream:
        return StreamingResponse(_events(ch, first), media_type="text/event-stream",
                                 headers=headers)
    try:
        for k, i in enumerate(ch.order):
            out, upd, stream = first if k == 0 else await ch.start(i)
            try:
                result = await out.collect(upd, stream, request)
            except EngineRequestError as e:
                raise APIError(500, f"the engine failed on this request: {e}", "server_error",
                               code="engine_error") from e
            if result is None:
                return error_response(499, "client closed the request")
    finally:
        await ch.close()
    if turn.cid is not None:
        headers["x-pensieve-stored"] = "false" if ch.outs[0].store_failure else "true"
    return JSONResponse(_final_body(ch), headers=headers)


def _final_body(ch: Choices) -> dict[str, Any]:
    out0 = ch.outs[0]
    assert out0.result is not None
    body = out0.final_body(out0.result)
    body["choices"] = [ch.outs[i].final_body(_result(ch.outs[i]))["choices"][0]
                       for i in range(ch.body.n)]
    body["usage"] = ch.usage()
    body["pensieve"]["cache"] = ch.cache()
    return body


def _result(out: TurnOutput) -> Result:
    assert out.result is not None
    return out.result


async def _events(ch: Choices, first: tuple[TurnOutput, Any, Any]) -> AsyncIterator[str]:
    """Each choice's events in turn (deltas tagged with its index), then the usage and
    ``[DONE]``; a choice that fails ends the stream with an error event."""
    try:
        for k, i in enumerate(ch.order):
            try:
                out, upd, stream = first if k == 0 else await ch.start(i)
            except APIError as e:
                yield error_event(e)
                yield "data: [DONE]\n\n"
                return
            async for event in out.sse(upd, stream, last=False):
                yield event
            if out.result is None:  # failed (its error event and [DONE] were sent)
                return
        if (ch.body.stream_options or {}).get("include_usage"):
            yield ch.outs[0].usage_chunk(ch.usage())
        yield "data: [DONE]\n\n"
    finally:
        await ch.close()
