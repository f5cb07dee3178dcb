"""The server's engine loop, apart from where its commands come from and where its updates go.

:class:`EngineLoop` owns an :class:`~pensieve.engine.llm_engine.LLMEngine`: it applies
commands (add a request, abort one, call a function on the engine), runs steps, and turns each
step into :class:`Update` objects, one per request that got a token, finished or failed. Two
transports drive it: a thread of the server process (:class:`~pensieve.server.async_engine.
AsyncEngine`) and a process of its own (:mod:`pensieve.server.engine_process`), which keeps
the engine's host work off the GIL the HTTP side holds.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from pensieve.core.outputs import TokenLogprobs
from pensieve.engine.request_output import RequestOutput
from pensieve.engine.step_record import StepLog, StepTotals
from pensieve.server.engine_ops import rebase
from pensieve.server.step_profile import StepProfile

log = logging.getLogger("pensieve.server")


COMPILE_NICE = 10
"""The grammar compile threads' nice value (Linux sets it per thread)."""
MAX_ABANDONED_COMPILES = 2
"""Grammar compiles past their time (they cannot be interrupted) left running beside the one
thread that compiles the others; past this many, new grammars wait behind them."""


def _compile_thread() -> queue.SimpleQueue[tuple[Future[Any], Any] | None]:
    """A daemon thread that runs the compiles put on the queue it returns, one at a time,
    until it gets None (a daemon: a compile that will not end never holds the process up),
    at a lower priority than the step loop's."""
    work: queue.SimpleQueue[tuple[Future[Any], Any] | None] = queue.SimpleQueue()

    def run() -> None:
        try:  # below the step loop: on a busy machine the steps get the CPU first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
        except (AttributeError, OSError):
            pass
        while (item := work.get()) is not None:
            fut, fn = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the reply carries it
                fut.set_exception(e)

    threading.Thread(target=run, name="pensieve-grammar", daemon=True).start()
    return work


def _build_compiler(engine: Any) -> Future[Any] | None:
    """Build the runner's grammar compiler (its tokenizer, xgrammar's tokenizer info: about
    0.4 s of CPU, many seconds on a loaded host) in a thread of its own at the engine's
    start, at the step loop's priority: the first constrained request used to build it in
    the compile thread (nice 10), within its compile timeout, and could get a 400. The
    server waits for it before it times a compile. None: no runner that compiles ahead."""
    build = getattr(getattr(engine, "runner", None), "grammar_compiler", None)
    if build is None:
        return None
    fut: Future[Any] = Future()

    def run() -> None:
        fut.set_running_or_notify_cancel()
        try:
            fut.set_result(build())
        except BaseException as e:  # noqa: BLE001 - no tokenizer: each request is told
            fut.set_exception(e)

    threading.Thread(target=run, name="pensieve-grammar-init", daemon=True).start()
    return fut


def _follow(fut: Future[Any]) -> Future[Any]:
    """A future resolved as ``fut`` is (True on success), cancelled without touching it."""
    out: Future[Any] = Future()

    def done(f: Future[Any]) -> None:
        if out.set_running_or_notify_cancel():
            err = f.exception()
            if err is not None:
                out.set_exception(err)
            else:
                out.set_result(True)

    fut.add_done_callback(done)
    return out


class EngineRequestError(RuntimeError):
    """The engine failed this request: its execution raised (failure containment: the other
    requests of the step went on) or the whole step did. The turn's conversation is as it
    was before the turn; nothing of the turn may be stored."""


class EngineStartError(RuntimeError):
    """The engine could not be built (a bad setting, a model that does not load): the server
    does not start, and ``pensieve serve`` says why in one line."""


class ServerStoppingError(EngineRequestError):
    """The server stopped while the turn ran (its graceful shutdown ran out): the turn was
    aborted, its conversation is as it was before the turn."""


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

    @property
    def is_last(self) -> bool:
        return self.output is not None or self.error is not None


@dataclass
class Snapshot:
    """Engine state for metrics, refreshed by the engine loop after each step."""

    running: int = 0
    waiting: int = 0
    stats: dict[str, int] | None = None
    steps: dict[str, float] | None = None
    """:class:`~pensieve.engine.step_record.StepTotals` since the server started."""


Reply = Callable[[Any, BaseException | None, Any], None]
"""``reply(token, error, result)``: the outcome of a ``call`` command."""


class EngineLoop:
    """Commands in, updates out; :meth:`take` hands over the updates gathered so far."""

    def __init__(self, engine: Any, reply: Reply) -> None:
        self.engine = engine
        self.reply = reply
        self.live: set[str] = set()
        """Requests whose stream still waits for updates."""
        self.updates: list[tuple[str, Update]] = []
        self.step_totals = StepTotals()
        engine.step_observers.append(self.step_totals)
        self.step_log: StepLog | None = None
        """``PENSIEVE_STEP_LOG``: every step as a JSON line, for the step-cost analyses."""
        path = os.environ.get("PENSIEVE_STEP_LOG")
        if path:
            try:
                self.step_log = StepLog(path)
            except OSError as e:  # serve anyway: the log is for analysis only
                log.warning("PENSIEVE_STEP_LOG=%s cannot be opened (%s): no step log", path, e)
            else:
                engine.step_observers.append(self.step_log)
        self.profile = StepProfile.from_env()
        """``PENSIEVE_PROFILE_STEPS``: a profiler trace of a window of steps."""
        self._compile_queue: queue.SimpleQueue[tuple[Future[Any], Any] | None] | None = None
        """The grammar compile thread's work (None: no thread yet)."""
        self.compiling: dict[Any, Future[Any]] = {}
        """Grammars compiling ahead of their requests, by the token their reply carries."""
        self._abandoned: list[Future[Any]] = []
        """Compiles the server gave up on, still running in threads of their own."""
        self.grammar_compiler: Future[Any] | None = _build_compiler(engine)
        """The runner's grammar compiler, building since the engine started (None: a runner
        that cannot compile ahead of a step)."""

    def snapshot(self) -> Snapshot:
        eng = self.engine
        return Snapshot(eng.num_running, eng.num_waiting, eng.counters(),
                        self.step_totals.as_dict())

    def take(self) -> list[tuple[str, Update]]:
        out, self.updates = self.updates, []
        return out

    def push(self, rid: str, upd: Update) -> None:
        if rid not in self.live:
            return
        self.updates.append((rid, upd))
        if upd.is_last:
            self.live.discard(rid)

    def handle(self, kind: str, arg: Any) -> None:
        eng = self.engine
        if kind == "add":
            rid, ids, params, cid, full_context, tenant, salt = arg
            self.live.add(rid)
            try:
                if full_context and cid is not None:
                    ids = rebase(eng, cid, ids)
                eng.add_request(rid, ids, params, conversation_id=cid, tenant=tenant,
                                cache_salt=salt)
            except Exception as e:  # noqa: BLE001 - handed to the waiting request
                self.push(rid, Update(error=e))
        elif kind == "abort":
            eng.abort_request(arg)
            self.live.discard(arg)
        elif kind == "call":
            token, fn, args = arg
            try:
                res = fn(eng, *args)
            except Exception as e:  # noqa: BLE001 - raised where the call was made
                self.reply(token, e, None)
            else:
                self.reply(token, None, res)
        elif kind == "grammar":
            self._compile(*arg)
        elif kind == "grammar_cancel":
            self._cancel_compile(arg)
        elif kind != "noop":
            raise ValueError(f"unknown engine command {kind!r}")

    def _compile(self, token: Any, spec: Any) -> None:
        """Compile ``spec`` into the runner's grammar cache in a thread of its own, off the
        step loop (the request is added once :meth:`reply_compiled` answered ``token``, and
        its compile at its first step is then a cache hit). A runner that cannot (tensor
        parallelism's executor) answers at once: its first step compiles. ``spec`` None:
        answer once the compiler is built (:data:`grammar_compiler`), compiling nothing."""
        runner = getattr(self.engine, "runner", None)
        compiler = getattr(runner, "grammar_compiler", None)
        if compiler is None:
            self.reply(token, None, False)
            return
        if spec is None:  # a future of its own: a cancelled wait leaves the build alone
            if self.grammar_compiler is None:  # a runner given since the start (tests)
                self.grammar_compiler = _build_compiler(self.engine)
            assert self.grammar_compiler is not None
            self.compiling[token] = _follow(self.grammar_compiler)
            return
        if self._compile_queue is None:
            self._compile_queue = _compile_thread()
        fut: Future[Any] = Future()
        self.compiling[token] = fut
        self._compile_queue.put((fut, lambda: compiler().compile(spec)))

    def _cancel_compile(self, token: Any) -> None:
        """The server gave up on a compile (its time ran out). One still queued never starts.
        One running cannot be interrupted: it is left to finish in its thread, and later
        grammars get a thread of their own instead of waiting behind it, while fewer than
        :data:`MAX_ABANDONED_COMPILES` such compiles run."""
        fut = self.compiling.pop(token, None)
        if fut is None or fut.cancel():
            return
        self._abandoned = [f for f in self._abandoned if not f.done()]
        if not fut.done() and len(self._abandoned) < MAX_ABANDONED_COMPILES:
            self._abandoned.append(fut)
            old, self._compile_queue = self._compile_queue, _compile_thread()
            assert old is not None
            while True:  # what waited behind it moves to the new thread
                try:
                    item = old.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    self._compile_queue.put(item)
            old.put(None)  # its thread ends after the abandoned compile

    def reply_compiled(self) -> None:
        """Answer the compiles that finished (an error: the grammar cannot compile)."""
        for token in [t for t, f in self.compiling.items() if f.done()]:
            fut = self.compiling.pop(token)
            err = fut.exception()
            self.reply(token, err, None if err is not None else True)

    def close(self) -> None:
        """The server stops: write what the step profile has and close the step log."""
        if self._compile_queue is not None:
            self._compile_queue.put(None)
        if self.profile is not None:
            self.profile.close()
        if self.step_log is not None:
            self.step_log.close()

    @property
    def busy(self) -> bool:
        return bool(self.engine.has_unfinished())

    def step(self) -> None:
        """One engine step; its tokens, outputs and errors become updates."""
        eng = self.engine
        prof = self.profile
        if prof is not None:
            prof.before_step()
        try:
            finished = eng.step()
        except Exception as e:  # noqa: BLE001 - a bug: fail what is in flight, keep serving
            log.exception("engine step failed")
            for rid in list(self.live):
                eng.abort_request(rid)
                self.push(rid, Update(error=EngineRequestError(f"engine step failed: {e}")))
            return
        finally:
            if prof is not None:
                prof.after_step()
        done = {o.request_id for o in finished}
        for rid, tok in eng.last_sampled.items():
            if rid not in done:
                req = eng.scheduler.requests.get(rid)
                first = req is not None and len(req.output_token_ids) == 1
                self.push(rid, Update(token=tok, logprobs=eng.last_logprobs.get(rid),
                                      cache=req.cache_stats.as_dict()
                                      if first and req is not None else None))
        for out in finished:
            if out.error is not None:  # contained: only this request failed
                self.push(out.request_id, Update(error=EngineRequestError(out.error)))
            else:
                self.push(out.request_id, Update(output=out))
