"""Running one turn: sampling parameters, the engine's token stream, and the answer as a JSON
body or as server-sent events.

Text streams as it is detokenized, with stop strings matched on it (:mod:`.text`); a stop
string ends the turn there as a stop token would (the engine finishes the request and keeps
its KV, the answer is trimmed before the stop string, and the conversation's history becomes
the context plus the tokens up to the one that completed it; the next turn's exact rendering
recomputes from the first token that differs). A completed turn is stored before the client
sees its end. A turn the client leaves, or that the engine fails (an OpenAI-shaped 500, or an
error event in a stream), leaves its conversation as it was.

A turn the store fails to write (disk full, read-only store) is still answered, marked as not
stored: ``"pensieve": {"stored": false}`` in the body (and the last chunk of a stream), the
``x-pensieve-stored: false`` header on a JSON answer, and in a stream an error event
(``store_unavailable``) before ``[DONE]``. Its conversation stays as the store has it (a new
one is forgotten: its id leads nowhere), and ``/health`` reports ``degraded`` until a write
succeeds again.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pensieve.core.outputs import TokenLogprobs
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.scheduler import ConversationBusyError
from pensieve.server import engine_ops
from pensieve.server.completions_echo import echo_choice, scoring_salt
from pensieve.server.engine_loop import EngineRequestError, ServerStoppingError
from pensieve.server.errors import APIError, error_response
from pensieve.server.logprobs import LogprobsFormatter
from pensieve.server.protocol import _Sampling
from pensieve.server.reasoning import ReasoningStream, split_reasoning
from pensieve.server.state import ServerState
from pensieve.server.store_sqlite import StoredConversation, StoreWriteError
from pensieve.server.structured import Constraint
from pensieve.server.text import IncrementalDetokenizer, StopStrings
from pensieve.server.tool_answer import ToolAnswer
from pensieve.server.turn_params import sampling_params, stop_lists, turn_max_tokens
from pensieve.server.turns import Turn, engine_call, off_loop
from pensieve.server.vllm_fields import response_id, silent_stop_ids, truncated

log = logging.getLogger("pensieve.server")


CACHED_SOURCES = ("gpu_hit_tokens", "cpu_hit_tokens", "shared_hit_tokens", "disk_hit_tokens")
"""The turn's cache statistics whose tokens OpenAI's ``cached_tokens`` counts: every context
token whose KV was not computed (read from the GPU or CPU tier, shared, or read back from the
disk tier or the shared KV tier)."""


@dataclass
class Result:
    """A finished turn, from the engine's output or from a stop string."""

    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str
    cache: dict[str, int]
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """One per context token when the request asked for prompt log-probabilities."""


async def run_turn(state: ServerState, body: _Sampling, turn: Turn, max_tokens: int | None,
                   request: Request, chat: bool, choices: Any = None,
                   constraint: Constraint | None = None) -> Response:
    """Run one turn and answer it, JSON or a stream. ``n > 1`` goes to ``choices``
    (:func:`pensieve.server.choices.run_choices`, passed in: it builds on this module);
    ``constraint``: a chat turn's grammar and tool-call format."""
    constraint = constraint or Constraint(None, None)
    if body.n > 1 and constraint.tool_format:
        await forget_new(state, turn)
        raise APIError(400, "n > 1 is not supported with tools", param="n")
    stored = turn.stored
    turn.prompt_ids = truncated(body, turn.prompt_ids, not turn.full_context
                                and stored is not None and bool(stored.token_ids))
    stop_texts, stop_ids = await off_loop(state, lambda: stop_lists(state, body))
    max_tokens = turn_max_tokens(state, len(turn.context_ids), max_tokens)
    params = sampling_params(state, body, max_tokens, stop_ids, constraint.grammar)
    if turn.cid is not None and (body.keep_alive_s is not None
                                 or body.retention_priority is not None):
        await engine_call(state, engine_ops.set_hints, turn.kv_id, body.retention_priority,
                          body.keep_alive_s, turn.tenant)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    shown = response_id(body, "chatcmpl-" if chat else "cmpl-", rid)
    t0 = time.monotonic()
    if body.n > 1:
        return await choices(state, body, turn, params, request, chat, stop_texts, rid)
    first, stream = await start(state, turn, rid, turn.prompt_ids, params, turn.kv_id,
                                turn.full_context, scoring_salt(params, body.cache_salt))
    state.metrics.ttft.observe(time.monotonic() - t0)
    out = TurnOutput(state, body, turn, shown, chat, t0, stop_texts, constraint.tool_format)
    out.engine_rid = rid
    headers = {"x-conversation-id": turn.cid} if turn.cid else {}
    if body.stream:
        return StreamingResponse(out.sse(first, stream), media_type="text/event-stream",
                                 headers=headers)
    try:
        result = await out.collect(first, stream, request)
    except EngineRequestError as e:
        await forget_new(state, turn)
        raise engine_error(e) from e
    if result is None:
        return error_response(499, "client closed the request")
    if turn.cid is not None:
        headers["x-pensieve-stored"] = "false" if out.store_failure else "true"
    return JSONResponse(out.final_body(result), headers=headers)


async def start(state: ServerState, turn: Turn, rid: str, prompt: list[int],
                params: SamplingParams, cid: str | None, full_context: bool,
                cache_salt: str | None = None) -> tuple[Any, Any]:
    """Submit a request; (its first update, the stream). A request refused before its first
    token is an APIError (409 busy, 400 invalid, 500/503 engine), its new conversation
    forgotten."""
    stream = state.engine.generate(rid, prompt, params, cid, full_context=full_context,
                                   tenant=turn.tenant, cache_salt=cache_salt)
    try:
        return await stream.__anext__(), stream
    except ConversationBusyError as e:
        raise APIError(409, str(e), code="conversation_busy", param="conversation_id") from e
    except ValueError as e:
        await forget_new(state, turn)
        raise refusal(e, "messages" if turn.new or turn.prev else "prompt") from e
    except EngineRequestError as e:
        await forget_new(state, turn)
        raise engine_error(e) from e


ENGINE_REFUSALS = (
    ("leaves no room to generate", "context", "context_length_exceeded"),
    ("needs more KV blocks than the GPU tier has", "context", "context_length_exceeded"),
    ("logit_bias token ids out of range", "logit_bias", "invalid_token_id"),
    ("token ids out of range", "prompt", "invalid_token_id"),
    ("empty prompt", "prompt", "empty_prompt"),
)
"""The engine's reasons to refuse a request at admission (the start of its message), with the
field they are about ("context": the messages, or a completion's prompt) and the error code."""


def refusal(e: ValueError, context_param: str) -> APIError:
    """The 400 of a request the engine refused, naming the field and a code where the
    engine's reason tells them (``param``/``code`` used to be null)."""
    text = str(e)
    for needle, param, code in ENGINE_REFUSALS:
        if needle in text:
            return APIError(400, text, param=context_param if param == "context" else param,
                            code=code)
    return APIError(400, text)


def engine_error(e: EngineRequestError) -> APIError:
    """The 500 of a request the engine failed (the others in its step went on), or the 503 of
    a turn the server's shutdown ended."""
    if isinstance(e, ServerStoppingError):
        return APIError(503, str(e), "server_error", code="shutting_down")
    return APIError(500, f"the engine failed on this request: {e}", "server_error",
                    code="engine_error")


async def forget_new(state: ServerState, turn: Turn) -> None:
    """A new conversation whose first turn failed leaves nothing behind in the engine (one
    that took another's engine conversation over gives it back)."""
    if turn.new_conversation and turn.cid is not None:
        if state.engine_ids.give_back(turn.cid):
            return
        try:
            await state.engine.call(engine_ops.forget_if_empty, turn.cid)
        except EngineRequestError:
            pass  # the engine is gone, and the conversation with it


def sse_data(obj: dict[str, Any]) -> str:
    """One SSE event. Line separators other than ``\\n`` (U+0085, U+2028, U+2029) are escaped:
    clients that split lines as ``str.splitlines`` does would break the JSON on them."""
    text = json.dumps(obj, ensure_ascii=False)
    text = text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    return "data: " + text.replace("\x85", "\\u0085") + "\n\n"


def error_event(err: APIError) -> str:
    """An error as a stream's event, as OpenAI's clients read it."""
    return sse_data({"error": {"message": err.message, "type": err.type, "param": err.param,
                               "code": err.code}})


class TurnOutput:
    """Formats one turn's stream or response and records the turn when it completes."""

    def __init__(self, state: ServerState, body: _Sampling, turn: Turn, rid: str, chat: bool,
                 t0: float, stops: list[str], tool_format: str | None = None,
                 index: int = 0, record: bool = True) -> None:
        self.state, self.body, self.turn, self.rid, self.chat, self.t0 = (
            state, body, turn, rid, chat, t0)
        self.tools = (ToolAnswer(tool_format, state.renderer,
                                 getattr(body, "parallel_tool_calls", True))
                      if tool_format else None)
        """Reads the answer's tool calls (and holds back streamed text that may begin one)."""
        self.engine_rid = rid
        """The engine's request (:attr:`rid`, the response's id, is the same but for a choice
        of ``n`` > 1)."""
        self.index = index
        """The choice this output is (``n`` > 1)."""
        self.record = record
        """Store the completed turn (only choice 0 continues the conversation)."""
        self.created = int(time.time())
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprobs | None] = []
        """One entry per token of :attr:`tokens` when the request asks for logprobs."""
        self.logprobs_sent = 0
        """Tokens whose logprobs a stream chunk carried."""
        self.cache: dict[str, int] = {}
        tok = state.renderer.tokenizer if state.renderer is not None else None
        self.logprobs_fmt = (LogprobsFormatter(tok, chat) if body.num_logprobs() is not None
                             else None)
        self.detok = (IncrementalDetokenizer(tok, body.skip_special_tokens,
                                             body.spaces_between_special_tokens)
                      if tok is not None else None)
        self.stops = StopStrings(stops, body.include_stop_str_in_output)
        self.silent_ids = silent_stop_ids(state, body, tok)
        """Stop tokens whose text the answer leaves out (:mod:`.vllm_fields`)."""
        self.result: Result | None = None
        thinks = chat and state.renderer is not None and state.renderer.thinks
        self.reasoning = ReasoningStream() if thinks else None
        """Splits a thinking model's streamed reasoning from its content."""
        self.first_token_t = self.last_token_t = t0
        self.store_failure: StoreWriteError | None = None
        """Why the completed turn is not stored (None: stored, or nothing to store)."""

    def _feed(self, token: int, logprobs: TokenLogprobs | None = None) -> str:
        self.tokens.append(token)
        self.logprobs.append(logprobs)
        now = time.monotonic()
        if len(self.tokens) > 1:
            self.state.metrics.itl.observe(now - self.last_token_t)
        else:
            self.first_token_t = now
        self.last_token_t = now
        armed = len(self.tokens) >= self.body.min_tokens  # no stop string before min_tokens
        if self.detok is None or token in self.silent_ids:
            return ""
        return self.stops.feed(self.detok.add(token), armed)

    async def updates(self, first: Any, stream: Any) -> AsyncIterator[tuple[str, Result | None]]:
        """(new text, None) per token, then (last text, the finished turn)."""
        upd = first
        while True:
            if upd.output is not None:
                out = upd.output
                n = len(self.tokens)
                lps = out.logprobs[n:] or [None] * (len(out.output_token_ids) - n)
                text = "".join(self._feed(t, lp)
                               for t, lp in zip(out.output_token_ids[n:], lps))
                if self.detok is not None:
                    text += self.stops.feed(self.detok.flush())
                text += self.stops.flush()
                finish = "stop" if self.stops.stopped else out.finish_reason
                result = Result(out.prompt_token_ids, out.output_token_ids, self.stops.text,
                                finish, out.cache_stats, out.prompt_logprobs or None)
                await self._finish(result)
                yield text, result
                return
            if upd.cache is not None:
                self.cache = upd.cache
            delta = self._feed(upd.token, upd.logprobs)
            if self.stops.stopped:
                result = Result(self.turn.context_ids, list(self.tokens), self.stops.text,
                                "stop", self.cache)
                await engine_call(self.state, engine_ops.stop_turn, self.engine_rid,
                                  self.turn.kv_id, result.prompt_ids + result.output_ids)
                await stream.aclose()  # the request is finished: no abort
                await self._finish(result)
                yield delta, result
                return
            if delta:
                yield delta, None
            upd = await stream.__anext__()

    async def _finish(self, result: Result) -> None:
        """Metrics, and the completed turn persisted (before the client sees its end)."""
        self.result = result
        m = self.state.metrics
        m.latency.observe(time.monotonic() - self.t0)
        m.generation_tokens.inc(len(result.output_ids))
        self.state.usage.add(self.turn.tenant, len(result.prompt_ids),
                             self.usage(result)["prompt_tokens_details"]["cached_tokens"],
                             len(result.output_ids), request=self.index == 0)
        if len(self.tokens) > 1:  # time per output token after the first
            m.tpot.observe((self.last_token_t - self.first_token_t) / (len(self.tokens) - 1))
        turn = self.turn
        if turn.cid is None or not self.record:
            return
        conv = turn.stored or StoredConversation(turn.cid, turn.tenant)
        if self.chat:
            # the answer as the client re-sends it: its tool calls, without a thinking
            # model's reasoning
            conv.messages = turn.prev + turn.new + [self._parts(result)[1]]
        else:
            conv.messages = conv.messages + [{"role": "completion", "content": result.text}]
        conv.token_ids = result.prompt_ids + result.output_ids
        if self.body.retention_priority is not None:
            conv.priority = self.body.retention_priority
        if self.body.keep_alive_s is not None:
            conv.keep_alive_s = self.body.keep_alive_s
        conv.turns = conv.turns + [{"context_len": len(result.prompt_ids),
                                    "output_len": len(result.output_ids)}]
        store = self.state.store
        try:
            await off_loop(self.state, lambda: store.save_turn(conv))
        except StoreWriteError as e:
            await self._not_stored(e)
            return
        self.state.store_error = None
        self.state.engine_ids.settle(turn.cid)

    async def _not_stored(self, e: StoreWriteError) -> None:
        """The turn was answered but the store refused it: say so, and leave nothing of a
        new conversation in the engine (the next turn of an old one restores its stored
        history)."""
        self.store_failure = e
        self.state.store_error = e.message
        log.error("conversation %s: the turn is answered but not stored: %s", self.turn.cid,
                  e.message)
        if (self.turn.new_conversation and self.turn.cid is not None
                and not self.state.engine_ids.give_back(self.turn.cid)):
            try:
                await self.state.engine.call(engine_ops.drop_conversation, self.turn.cid)
            except (EngineRequestError, ConversationBusyError):
                pass  # the engine is gone, or the next turn already started

    def _pensieve(self, result: Result) -> dict[str, Any]:
        """The body's ``pensieve`` object: the turn's cache statistics and whether it is
        stored."""
        return {"cache": result.cache, "stored": self.store_failure is None}

    def usage(self, result: Result) -> dict[str, Any]:
        n_in, n_out = len(result.prompt_ids), len(result.output_ids)
        cached = sum(result.cache.get(k, 0) for k in CACHED_SOURCES)
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def final_body(self, result: Result) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": self.index,
                                  "finish_reason": self._finish_reason(result),
                                  "logprobs": self._logprobs(len(result.output_ids))}
        if self.chat:
            choice["message"] = self._api_message(result)
        else:
            choice["text"] = result.text
            if getattr(self.body, "echo", False):
                echo_choice(self, result, choice)
        return {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self._model(), "choices": [choice],
                "usage": self.usage(result), "conversation_id": self.turn.cid,
                "pensieve": self._pensieve(result)}

    def _model(self) -> str:
        return self.body.model or self.state.model_name

    def _parts(self, result: Result) -> tuple[str | None, dict[str, Any]]:
        """A thinking model's reasoning (None if none) and the answer as an assistant message
        as the client re-sends it (canonical, :mod:`.tools`): its tool calls, or its content
        without the reasoning. The answer's text is read once."""
        if self.tools is not None:
            content, calls = self.tools.read(result)
            if calls:
                return None, {"role": "assistant", "content": content, "tool_calls": calls}
        if self.reasoning is None:
            return None, {"role": "assistant", "content": result.text}
        reasoning, text = split_reasoning(result.text)
        return reasoning, {"role": "assistant", "content": text}

    def _api_message(self, result: Result) -> dict[str, Any]:
        """The message of :meth:`_parts` as OpenAI returns it: no content beside calls is
        ``null``, and a thinking model's reasoning as ``reasoning_content``."""
        reasoning, m = self._parts(result)
        if m.get("tool_calls"):
            return {**m, "content": None} if not m["content"] else m
        if self.reasoning is not None:
            m["reasoning_content"] = reasoning
        return m

    def _finish_reason(self, result: Result) -> str:
        calls = self.tools.read(result)[1] if self.tools is not None else []
        return "tool_calls" if calls and result.finish_reason == "stop" else result.finish_reason

    async def collect(self, first: Any, stream: Any, request: Request) -> Result | None:
        async for _, result in self.updates(first, stream):
            if result is not None:
                return result
            if await request.is_disconnected():
                await stream.aclose()  # aborts the request; the turn is not recorded
                await forget_new(self.state, self.turn)
                return None
        return None

    def _logprobs(self, end: int) -> dict[str, Any] | None:
        """The logprobs object of the tokens from the last one sent up to ``end``."""
        if self.logprobs_fmt is None:
            return None
        start, self.logprobs_sent = self.logprobs_sent, end
        return self.logprobs_fmt.format(self.tokens[start:end], self.logprobs[start:end])

    def _chunk(self, delta: str, finish: str | None, first: bool = False,
               extra: dict[str, Any] | None = None,
               extra_delta: dict[str, Any] | None = None) -> str:
        lp = None if first else self._logprobs(len(self.tokens))
        if self.chat:
            d: dict[str, Any] = {"content": delta, **(extra_delta or {})}
            if self.reasoning is not None:
                r, c = self.reasoning.feed(delta)
                if finish is not None:
                    r2, c2 = self.reasoning.flush()
                    r, c = r + r2, c + c2
                d = {**d, "content": c, **({"reasoning_content": r} if r else {})}
            if first:
                d["role"] = "assistant"
            choice: dict[str, Any] = {"index": self.index, "delta": d, "finish_reason": finish,
                                      "logprobs": lp}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": self.index, "text": delta, "finish_reason": finish,
                      "logprobs": lp}
            obj = "text_completion"
        return sse_data({"id": self.rid, "object": obj, "created": self.created,
                         "model": self._model(), "choices": [choice],
                         "conversation_id": self.turn.cid, **(extra or {})})

    def usage_chunk(self, usage: dict[str, Any]) -> str:
        """The last event's usage, when ``stream_options.include_usage`` asks for it."""
        return sse_data({"id": self.rid, "object": "chat.completion.chunk" if self.chat
                         else "text_completion", "created": self.created,
                         "model": self._model(), "choices": [], "usage": usage,
                         "conversation_id": self.turn.cid})

    def _tool_chunks(self, result: Result) -> list[str]:
        """The end of a tool-reading stream: the content it still owes, then one ``tool_calls``
        delta per call."""
        assert self.tools is not None
        calls = self.tools.read(result)[1]
        out = [self._chunk(self.tools.last_content(result), None)]
        for i, call in enumerate(calls):
            out.append(self._chunk("", None, extra_delta={"tool_calls": [{**call, "index": i}]}))
        return out

    async def sse(self, first: Any, stream: Any, last: bool = True) -> AsyncIterator[str]:
        """The turn's events; with ``last`` the usage and ``[DONE]`` too (not when more
        choices follow). :attr:`result` is set when the turn completed."""
        completed = False
        try:
            yield self._chunk("", None, first=True)
            try:
                async for delta, result in self.updates(first, stream):
                    if result is None:
                        text = delta if self.tools is None else self.tools.feed(delta)
                        if text:
                            yield self._chunk(text, None)
                        continue
                    completed = True
                    if self.tools is not None:
                        for chunk in self._tool_chunks(result):
                            yield chunk
                        delta = ""
                    yield self._chunk(delta, self._finish_reason(result),
                                      extra={"pensieve": self._pensieve(result)})
                    if last and (self.body.stream_options or {}).get("include_usage"):
                        yield self.usage_chunk(self.usage(result))
                if self.store_failure is not None:
                    yield error_event(self.store_failure)
            except EngineRequestError as e:  # an error event, as OpenAI's clients read it
                yield error_event(engine_error(e))
            except APIError as e:  # the turn's write refused (a stale turn)
                yield error_event(e)
            if last or not completed:
                yield "data: [DONE]\n\n"
        finally:
            if not completed:  # the client went away or the engine failed the request: the
                await stream.aclose()  # turn is aborted, the conversation left as it was
                await forget_new(self.state, self.turn)
