"""The engine driven from asyncio: :class:`EngineClient`, and the engine in a thread.

Every call into :class:`LLMEngine` happens where the engine lives, one command at a time; the
event loop sends commands (add a request, abort one, call a function on the engine) and
receives, per request, a stream of :class:`Update` objects on an ``asyncio.Queue``, the
updates of a step handed over in one batch. So the event loop never blocks on a model step,
and the engine's state is never touched from two threads. :class:`AsyncEngine` runs the
engine in a thread of the server process; :class:`~pensieve.server.engine_process.
ProcessEngine` runs it in a process of its own (``pensieve serve --engine-process``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from pensieve.core.sampling_params import SamplingParams
from pensieve.engine.llm_engine import LLMEngine
from pensieve.server.engine_loop import (
    EngineLoop,
    EngineRequestError,
    ServerStoppingError,
    Snapshot,
    Update,
)

log = logging.getLogger("pensieve.server")

__all__ = ["AsyncEngine", "EngineClient"]


class EngineClient:
    """The event loop's side: streams and pending calls; a subclass delivers commands.

    Watchdog. The engine reports progress after every step and, when idle, every
    :data:`~pensieve.server.engine_process.IDLE_POLL_S` (a heartbeat). With ``watchdog_s``
    set, an engine that has reported nothing for that long is *hung* (stopped by a signal,
    deadlocked, stuck in a step): :attr:`alive` turns false for good, every stream and pending
    call fails at once, and ``pensieve serve`` answers ``/health`` with a 503 and exits
    non-zero for its supervisor to restart it (SGLang's ``--watchdog-timeout``)."""

    snapshot: Snapshot

    def __init__(self, watchdog_s: float | None = None) -> None:
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Update]]] = {}
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self._call_ids = itertools.count()
        self.watchdog_s = watchdog_s
        """Seconds without progress after which the engine counts as hung (None: never)."""
        self.last_progress = time.monotonic()
        """When the engine last reported (``time.monotonic()``)."""
        self.hung = False
        """The watchdog found the engine hung (for good: the server restarts)."""

    def progress(self) -> None:
        """The engine reported: a step, a call's result, or its idle heartbeat."""
        self.last_progress = time.monotonic()

    @property
    def responsive(self) -> bool:
        """False once the engine went ``watchdog_s`` without progress; that moment fails
        everything in flight (their conversations stay as before their turns)."""
        if self.hung or self.watchdog_s is None:
            return not self.hung
        silent = time.monotonic() - self.last_progress
        if silent > self.watchdog_s:
            self.hung = True
            log.error("the engine made no progress for %.1f s (--watchdog-timeout %g): it is "
                      "hung; failing what is in flight", silent, self.watchdog_s)
            self._fail_all(EngineRequestError(
                f"the engine made no progress for {silent:.0f} s (the watchdog's limit is "
                f"{self.watchdog_s:g} s): the server restarts"))
        return not self.hung

    def _send(self, kind: str, arg: Any) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        """Whether the engine still serves (its thread or process runs)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ from the event loop
    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(engine, *args)`` where the engine lives and return its result (or raise).
        ``fn`` is a module-level function (:mod:`pensieve.server.engine_ops`): with the
        engine in its own process, the call is pickled."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        token = next(self._call_ids)
        self._calls[token] = (loop, fut)
        try:
            self._send("call", (token, fn, args))
        except BaseException:
            self._calls.pop(token, None)
            raise
        return await fut

    async def compile_grammar(self, spec: Any) -> bool:
        """Compile a request's grammar where the engine lives, off its step loop, before the
        request is added (so no step waits for it); raises the compiler's ``ValueError`` for
        one that cannot compile. False: the engine cannot compile ahead (its first step
        will). Cancelled (a timeout), a compile still queued never runs. ``spec`` None: only
        wait until the engine's compiler is built (it starts building with the engine)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        token = next(self._call_ids)
        self._calls[token] = (loop, fut)
        try:
            self._send("grammar", (token, spec))
            return bool(await fut)
        except asyncio.CancelledError:
            try:
                self._send("grammar_cancel", token)
            except EngineRequestError:
                pass
            raise
        finally:
            self._calls.pop(token, None)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        conversation_id: str | None = None,
        full_context: bool = False,
        tenant: str = "",
        cache_salt: str | None = None,
    ) -> AsyncIterator[Update]:
        """Yield each sampled token, then the finished output. Closing the iterator early (a
        client that went away) aborts the request and frees its blocks. A request the engine
        failed raises :class:`EngineRequestError` (its conversation is as before the turn).

        ``full_context``: ``prompt_token_ids`` is the turn's whole context, not only what
        follows the conversation's history. The history is kept up to its first token that
        differs from that context (the KV past it is freed) and the rest is computed, so the
        model sees exactly ``prompt_token_ids`` whatever the history held.
        ``tenant``, ``cache_salt``: whose prefixes it may share (``EngineCore.add_request``)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Update] = asyncio.Queue()
        self._streams[request_id] = (loop, q)
        done = False
        try:
            self._send("add", (request_id, prompt_token_ids, params, conversation_id,
                               full_context, tenant, cache_salt))
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
                self._streams.pop(request_id, None)
                try:
                    self._send("abort", request_id)
                except EngineRequestError:
                    pass  # the engine is gone: nothing to abort

    # ------------------------------------------------------------------ from the engine side
    def _dispatch(self, updates: list[tuple[str, Update]]) -> None:
        """Hand a step's updates to their streams: one wake-up per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Update], Update]]] = {}
        for rid, upd in updates:
            entry = self._streams.get(rid)
            if entry is None:
                continue
            loop, q = entry
            by_loop.setdefault(loop, []).append((q, upd))
            if upd.is_last:
                self._streams.pop(rid, None)
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # its event loop is closed (the server is shutting down)
                for rid in [r for r, (lp, _) in list(self._streams.items()) if lp is loop]:
                    self._streams.pop(rid, None)

    def _resolve(self, token: Any, error: BaseException | None, result: Any) -> None:
        entry = self._calls.pop(token, None)
        if entry is None:
            return
        loop, fut = entry
        try:
            if error is not None:
                loop.call_soon_threadsafe(_set_exception, fut, error)
            else:
                loop.call_soon_threadsafe(_set_result, fut, result)
        except RuntimeError:  # its event loop is closed
            pass

    def end_streams(self, reason: str) -> int:
        """End every stream in flight with a :class:`ServerStoppingError` (``reason``) and
        abort its request (the server is stopping); returns how many there were."""
        rids = list(self._streams)
        self._dispatch([(rid, Update(error=ServerStoppingError(reason))) for rid in rids])
        for rid in rids:
            try:
                self._send("abort", rid)
            except EngineRequestError:
                break  # the engine is gone: nothing to abort
        return len(rids)

    def _fail_all(self, error: BaseException) -> None:
        """The engine is gone: every stream and pending call gets ``error``."""
        self._dispatch([(rid, Update(error=error)) for rid in list(self._streams)])
        for token in list(self._calls):
            self._resolve(token, error, None)


class AsyncEngine(EngineClient):
    """Runs ``engine.step()`` in a background thread while requests are in flight."""

    def __init__(self, engine: LLMEngine, watchdog_s: float | None = None) -> None:
        super().__init__(watchdog_s)
        self.engine = engine
        self._cmds: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._core = EngineLoop(engine, self._resolve)
        self.snapshot = self._core.snapshot()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pensieve-engine", daemon=True)
        self._thread.start()

    def _send(self, kind: str, arg: Any) -> None:
        self._cmds.put((kind, arg))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.responsive

    def shutdown(self) -> None:
        self._stop.set()
        self._cmds.put(("noop", None))
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        core = self._core
        while not self._stop.is_set():
            try:
                core.reply_compiled()
                if core.busy:
                    while True:
                        core.handle(*self._cmds.get_nowait())
                else:
                    self.snapshot = core.snapshot()
                    self.progress()
                    core.handle(*self._cmds.get(timeout=0.02 if core.compiling else 0.5))
                    self._dispatch(core.take())
                    continue
            except queue.Empty:
                pass
            if core.busy:
                core.step()
            self._dispatch(core.take())
            self.snapshot = core.snapshot()
            self.progress()
        core.close()
        log.info("engine thread stopped at %s", time.strftime("%X"))


def _put_all(items: list[tuple[asyncio.Queue[Update], Update]]) -> None:
    for q, upd in items:
        q.put_nowait(upd)


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
