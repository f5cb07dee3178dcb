"""The engine in its own thread, driven from asyncio.

Every call into :class:`LLMEngine` happens on one engine thread; the event loop talks to it
through a command queue and receives, per request, a stream of :class:`Update` objects on an
``asyncio.Queue``. So the event loop never blocks on a model step, and the engine's state is
never touched from two threads.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pensieve.core.outputs import TokenLogprobs
from pensieve.core.request import Request
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.scheduler import ConversationBusyError
from pensieve.engine.llm_engine import LLMEngine
from pensieve.engine.outputs import RequestOutput
from pensieve.engine.step_record import StepTotals

log = logging.getLogger("pensieve.server")


class EngineRequestError(RuntimeError):
    """The engine failed this request: its execution raised (failure containment: the other
    requests of the step went on) or the whole step did. The turn's conversation is as it
    was before the turn; nothing of the turn may be stored."""


@dataclass
class Update:
    """One event of a request: a new token, the finished output, or an error."""

    token: int | None = None
    logprobs: TokenLogprobs | None = None
    """With a token, for a request that asks for them: its log-probabilities."""
    output: RequestOutput | None = None
    error: BaseException | None = None
    cache: dict[str, int] | None = None
    """With a request's first token: where its context's KV came from (cache stats)."""


@dataclass
class Snapshot:
    """Engine state for metrics, refreshed by the engine thread after each step."""

    running: int = 0
    waiting: int = 0
    stats: dict[str, int] | None = None
    steps: dict[str, float] | None = None
    """:class:`~pensieve.engine.step_record.StepTotals` since the server started."""


class AsyncEngine:
    """Runs ``engine.step()`` in a background thread while requests are in flight."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cmds: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Update]]] = {}
        self.step_totals = StepTotals()
        engine.step_observers.append(self.step_totals)
        self.snapshot = Snapshot(stats=engine.cache_stats(), steps=self.step_totals.as_dict())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pensieve-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._cmds.put(("noop", None))
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ from the event loop
    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread and return its result (or raise)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._cmds.put(("call", (fn, loop, fut)))
        return await fut

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        conversation_id: str | None = None,
        full_context: bool = False,
    ) -> AsyncIterator[Update]:
        """Yield each sampled token, then the finished output. Closing the iterator early (a
        client that went away) aborts the request and frees its blocks. A request the engine
        failed raises :class:`EngineRequestError` (its conversation is as before the turn).

        ``full_context``: ``prompt_token_ids`` is the turn's whole context, not only what
        follows the conversation's history. The history is kept up to its first token that
        differs from that context (the KV past it is freed) and the rest is computed, so the
        model sees exactly ``prompt_token_ids`` whatever the history held."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Update] = asyncio.Queue()
        self._streams[request_id] = (loop, q)
        self._cmds.put(("add", (request_id, prompt_token_ids, params, conversation_id,
                                full_context)))
        done = False
        try:
            while True:
                upd = await q.get()
                if upd.error is not None:
                    done = True
                    raise upd.error
                if upd.output is not None:
                    done = True
                    yield upd
                    return
                yield upd
        finally:
            if not done:
                self._cmds.put(("abort", request_id))

    # ------------------------------------------------------------------ engine thread
    def _push(self, request_id: str, upd: Update) -> None:
        entry = self._streams.get(request_id)
        if entry is None:
            return
        loop, q = entry
        try:
            loop.call_soon_threadsafe(q.put_nowait, upd)
        except RuntimeError:  # its event loop is closed (the server is shutting down)
            self._streams.pop(request_id, None)
            return
        if upd.output is not None or upd.error is not None:
            self._streams.pop(request_id, None)

    def _handle(self, kind: str, arg: Any) -> None:
        eng = self.engine
        if kind == "add":
            rid, ids, params, cid, full_context = arg
            try:
                if full_context and cid is not None:
                    ids = _rebase(eng, cid, ids)
                eng.add_request(rid, ids, params, conversation_id=cid)
            except Exception as e:  # noqa: BLE001 - handed to the waiting request
                self._push(rid, Update(error=e))
        elif kind == "abort":
            eng.abort_request(arg)
            self._streams.pop(arg, None)
        elif kind == "call":
            fn, loop, fut = arg
            try:
                res = fn(eng)
            except Exception as e:  # noqa: BLE001
                loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                loop.call_soon_threadsafe(_set_result, fut, res)

    def _refresh(self) -> None:
        eng = self.engine
        self.snapshot = Snapshot(eng.num_running, eng.num_waiting, eng.cache_stats(),
                                 self.step_totals.as_dict())

    def _loop(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            try:
                if eng.has_unfinished():
                    while True:
                        self._handle(*self._cmds.get_nowait())
                else:
                    self._refresh()
                    self._handle(*self._cmds.get(timeout=0.5))
                    continue
            except queue.Empty:
                pass
            if not eng.has_unfinished():
                continue
            try:
                finished = eng.step()
            except Exception as e:  # noqa: BLE001 - a bug: fail what is in flight, keep serving
                log.exception("engine step failed")
                for rid in list(self._streams):
                    eng.abort_request(rid)
                    self._push(rid, Update(error=EngineRequestError(f"engine step failed: {e}")))
                continue
            done = {o.request_id for o in finished}
            for rid, tok in eng.last_sampled.items():
                if rid not in done:
                    req = eng.scheduler.requests.get(rid)
                    first = req is not None and len(req.output_token_ids) == 1
                    self._push(rid, Update(token=tok, logprobs=eng.last_logprobs.get(rid),
                                           cache=req.cache_stats.as_dict()
                                           if first and req is not None else None))
            for out in finished:
                if out.error is not None:  # contained: only this request failed
                    self._push(out.request_id, Update(error=EngineRequestError(out.error)))
                else:
                    self._push(out.request_id, Update(output=out))
            self._refresh()
        log.info("engine thread stopped at %s", time.strftime("%X"))


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]: bisect with C-speed slice compares
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _rebase(eng: LLMEngine, cid: str, context: list[int]) -> list[int]:
    """The tokens to add after the conversation's history so that it becomes ``context``:
    the history is cut at its first token that differs (at least one token stays to add)."""
    history = eng.conversation_history(cid)
    keep = max(0, min(common_prefix_len(history, context), len(context) - 1))
    if keep < len(history):
        log.debug("conversation %s: history re-rendered from token %d of %d", cid, keep,
                  len(history))
        truncate_history(eng, cid, keep)
    return context[keep:]


def truncate_history(eng: LLMEngine, cid: str, num_tokens: int) -> None:
    """Cut an idle conversation's history to its first ``num_tokens`` tokens; the KV past
    them is freed (in both tiers) and the next turn computes what follows."""
    if cid in eng.scheduler.busy_conversations:
        raise ConversationBusyError(f"conversation {cid!r} has a turn running")
    conv = eng.cache.conversations.get(cid)
    if conv is None or num_tokens >= len(conv.token_ids):
        return
    conv.token_ids = conv.token_ids[:num_tokens]
    # What abandoning a turn does to an idle conversation (it reads nothing of the turn):
    # KV past the history goes, chunks wholly past it are freed, the eviction index rebuilt.
    eng.cache.abort_turn(_NO_TURN, conv, eng.now())


def set_history(eng: LLMEngine, cid: str, token_ids: list[int]) -> None:
    """Make an idle conversation's history ``token_ids``: the KV of its common prefix with the
    old history is kept, the rest is computed by the next turn."""
    conv = eng.cache.conversations.get(cid)
    if conv is None:
        return
    truncate_history(eng, cid, common_prefix_len(conv.token_ids, token_ids))
    conv.token_ids = list(token_ids)


_NO_TURN = Request("(history truncation)", [0], SamplingParams())


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
