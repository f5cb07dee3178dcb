"""The engine in a process of its own (`pensieve serve`'s default; `--no-engine-process` keeps
it in a thread of the server process).

In a thread of the server process the engine shares one GIL with the event loop, which
streams every token as an SSE event, parses requests and renders histories, so the runner's
host time before each forward grew while the GPU idled (measured: docs/benchmarks.md,
"Current engine: steady-state points ...", the item "The server's host time"). Here the
engine runs in a child process (spawned: CUDA is initialised only there) with its own
interpreter; the server process keeps the HTTP side, the tokenizer and the conversation store.
A spawned child starts before the server has settled the engine's config: it imports torch
and the engine meanwhile, then waits for the config on its command pipe. A CPU engine of a
single-threaded server is forked instead, once the server has imported torch for its config
(``pensieve.server.main._forks_engine``): the child does not import it again.

Two pipes link them. Commands go down (``add``, ``abort``, ``call`` with a module-level
function and its arguments, ``stop``); the child's :class:`~pensieve.server.engine_loop.
EngineLoop` sends up, per step, one message with that step's updates and a fresh
:class:`~pensieve.server.engine_loop.Snapshot`, and the result of each call with the
snapshot after it (so ``/metrics`` read after a call returns sees what the call did). A
reader thread in the server hands those to the event loop (one wake-up per step). If the
child dies, every stream and pending call fails with :class:`EngineRequestError` and so
does every new request (a 500); the conversations in the store are as their last completed
turn left them. ``pensieve serve`` then shuts down with status 1 for its supervisor to
restart it (:mod:`pensieve.server.shutdown`).
"""

from __future__ import annotations

import atexit
import gc
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any, NoReturn

from pensieve.server.async_engine import EngineClient
from pensieve.server.engine_loop import EngineLoop, EngineRequestError, EngineStartError, Snapshot
from pensieve.threads import set_thread_env, settle_engine_threads

log = logging.getLogger("pensieve.server")

IDLE_POLL_S = 0.5
"""How often an idle engine process sends a fresh snapshot (and checks its pipe)."""
COMPILE_POLL_S = 0.02
"""How often an idle engine process looks whether a grammar compiling for a request is done."""


class ProcessEngine(EngineClient):
    """:class:`~pensieve.server.async_engine.AsyncEngine`'s interface over an engine in a
    child process. Given its config, it blocks until the engine is built (or raises
    :class:`EngineStartError` with the child's error). Without one, the process starts at
    once and imports the engine's modules while the caller settles the config
    (``pensieve serve`` opens its store and loads its tokenizer meanwhile); :meth:`configure`
    sends it, :meth:`wait_ready` blocks until the engine is built."""

    def __init__(self, cfg: Any = None, log_level: str = "INFO",
                 watchdog_s: float | None = None, start_method: str = "spawn") -> None:
        super().__init__(watchdog_s)
        set_thread_env()  # before the child starts: its OpenMP runtime reads them on load
        ctx = mp.get_context(start_method)
        cmd_r, self._cmd_w = ctx.Pipe(duplex=False)
        self._out_r, out_w = ctx.Pipe(duplex=False)
        # a forked child holds copies of this side's ends: it closes them (or it would never
        # see the server's end close)
        ours = (self._cmd_w, self._out_r) if start_method == "fork" else ()
        self._proc = ctx.Process(target=engine_main, args=(cmd_r, out_w, log_level, ours),
                                 name="pensieve-engine", daemon=False)
        self._proc.start()
        cmd_r.close()
        out_w.close()
        self._lock = threading.Lock()
        self._closed = False
        self._ready = False
        if cfg is not None:
            self.configure(cfg)
            self.wait_ready()

    def configure(self, cfg: Any) -> None:
        """Send the engine's config: the process builds the engine from it."""
        try:
            self._cmd_w.send(cfg)
        except OSError:  # the process is gone (it failed on import): wait_ready says so
            pass

    def wait_ready(self) -> None:
        """Block until the engine is built; :class:`EngineStartError` if it failed."""
        try:
            kind, info = self._out_r.recv()
        except EOFError:
            kind, info = "failed", f"the engine process exited ({self._proc.exitcode})"
        if kind != "ready":
            self._proc.join(timeout=10)
            raise EngineStartError(f"the engine process failed to start: {info}")
        self.info: dict[str, Any] = info
        """What the server needs to know of the engine: ``kv_tokens`` (GPU tier),
        ``max_turn_tokens`` (:attr:`Scheduler.max_turn_tokens`), ``device`` (its type) and
        ``threads`` (:func:`pensieve.threads.thread_settings` there)."""
        self.snapshot: Snapshot = info["snapshot"]
        self.progress()
        self._reader = threading.Thread(target=self._read, name="pensieve-engine-reader",
                                        daemon=True)
        self._reader.start()
        self._outbox: queue.SimpleQueue[tuple[str, Any] | None] = queue.SimpleQueue()
        """Commands for the writer thread: a pipe's send blocks once its buffer is full (a
        stopped engine reads nothing), and the event loop must never block on it."""
        self._writer = threading.Thread(target=self._write, name="pensieve-engine-writer",
                                        daemon=True)
        self._writer.start()
        self._ready = True

    @property
    def alive(self) -> bool:
        return not self._closed and self._proc.is_alive() and self.responsive

    def _send(self, kind: str, arg: Any) -> None:
        with self._lock:
            if self._closed or self.hung:
                raise EngineRequestError("the engine process is not running")
            self._outbox.put((kind, arg))

    def _write(self) -> None:
        """Send the commands in order; a broken pipe (the child is gone) ends the thread, and
        the reader, seeing the pipe close, fails what is in flight."""
        while (item := self._outbox.get()) is not None:
            try:
                self._cmd_w.send(item)
            except (OSError, ValueError):
                return

    def _read(self) -> None:
        while True:
            try:
                msg = self._out_r.recv()
            except (EOFError, OSError):
                break
            self.progress()
            kind = msg[0]
            if kind == "step":
                self._dispatch(msg[1])
                self.snapshot = msg[2]
            elif kind == "result":  # with the engine's state after the call
                self.snapshot = msg[4]
                self._resolve(msg[1], msg[2], msg[3])
            elif kind == "snapshot":
                self.snapshot = msg[1]
        with self._lock:
            was_closed, self._closed = self._closed, True
        if not was_closed:
            log.error("the engine process exited (code %s): failing what is in flight",
                      self._proc.exitcode)
        self._fail_all(EngineRequestError("the engine process exited"))

    def shutdown(self) -> None:
        """Stop the engine process: ask it, then terminate it, then kill it (a hung one at
        once: a stopped process never reads its pipe, and the server would wait on it at
        exit). One not built yet (the server failed while settling its config) ends as its
        pipe closes, or is killed: nothing ran on it."""
        if not self._ready:
            self._closed = True
            self._cmd_w.close()
            self._proc.join(timeout=5)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(timeout=10)
            return
        if not self.hung:
            try:
                self._send("stop", None)
            except EngineRequestError:
                pass
        with self._lock:
            self._closed = True
        self._outbox.put(None)
        if not self.hung:
            self._writer.join(timeout=30)
        self._proc.join(timeout=0 if self.hung else 30)
        if self._proc.is_alive() and not self.hung:
            self._proc.terminate()
            self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()  # SIGKILL ends a stopped process too
            self._proc.join(timeout=10)
        self._cmd_w.close()
        self._reader.join(timeout=10)


def _sendable(out: Connection, msg: tuple[Any, ...]) -> None:
    """Send ``msg``; a result or error that does not pickle goes as a ``RuntimeError``."""
    try:
        out.send(msg)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        if msg[0] != "result":
            raise
        out.send(("result", msg[1], RuntimeError(f"unpicklable engine result: {e}"), None,
                  msg[4]))


def engine_main(cmds: Connection, out: Connection, log_level: str,
                server_ends: tuple[Connection, ...] = ()) -> None:
    """The child: import the engine's modules (the server settles the config meanwhile),
    build the engine from the config the server sends, then apply commands and run steps
    until ``stop`` or until the server's end of the pipe closes. ``server_ends``: in a
    forked child, the server's ends of the two pipes, closed here."""
    for end in server_ends:
        end.close()
    # The server stops it: Ctrl-C in a terminal and a service manager's SIGTERM reach the
    # whole process group, and the server's graceful shutdown lets turns in flight finish
    # first. If the server dies instead, the engine sees its pipe close and exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), force=True,  # (forked: the server's format)
                        format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    from pensieve.engine.llm_engine import LLMEngine

    try:
        cfg = cmds.recv()
    except (EOFError, OSError):  # the server stopped before it settled the config
        return
    try:
        engine = LLMEngine(cfg)
    except BaseException as e:  # noqa: BLE001 - reported to the server, which raises
        out.send(("failed", f"{type(e).__name__}: {e}"))
        return
    core: EngineLoop

    def reply(token: Any, err: BaseException | None, res: Any) -> None:
        _sendable(out, ("result", token, err, res, core.snapshot()))

    threads = settle_engine_threads(engine.device.type)
    core = EngineLoop(engine, reply)
    kv_tokens = engine.cache.gpu.num_blocks * engine.cache.chunk_size
    out.send(("ready", {"kv_tokens": kv_tokens, "snapshot": core.snapshot(),
                        "max_turn_tokens": engine.scheduler.max_turn_tokens,
                        "device": engine.device.type, "threads": threads}))
    gc.freeze()  # the engine lives as long as the process: no collections over its objects
    try:
        _serve(core, cmds, out)
    finally:
        core.close()
        engine.shutdown()
    if not server_ends:  # a forked child leaves as multiprocessing ends it: os._exit
        _exit_without_teardown()


def _exit_without_teardown() -> NoReturn:
    """End the engine process as its interpreter would (exit handlers run, output flushed)
    but without tearing its modules down: with torch loaded that took ~1 s of every server's
    stop, and on a frozen heap (:func:`gc.freeze`) extensions built on nanobind (triton) report
    as leaks the objects that teardown no longer frees. Threads are not joined: the engine's
    shutdown has waited for its writers (disk and remote tiers), and what is left are idle
    pool workers (a grammar compile thread), which the interpreter would first have to wake."""
    atexit._run_exitfuncs()  # multiprocessing's finalizers, logging's flush
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _serve(core: EngineLoop, cmds: Connection, out: Connection) -> None:
    """Apply commands and run steps until ``stop``, or until the server is gone: its end of
    either pipe closed (a server killed under load, with steps still to report)."""
    try:
        _loop(core, cmds, out)
    except (BrokenPipeError, ConnectionResetError):
        log.warning("the server closed its pipe: the engine process stops")


def _loop(core: EngineLoop, cmds: Connection, out: Connection) -> None:
    while True:
        core.reply_compiled()
        busy = core.busy
        idle_poll = COMPILE_POLL_S if core.compiling else IDLE_POLL_S
        try:
            if cmds.poll(0 if busy else idle_poll):
                while True:
                    kind, arg = cmds.recv()
                    if kind == "stop":
                        return
                    core.handle(kind, arg)
                    if not cmds.poll(0):
                        break
            elif not busy:
                out.send(("snapshot", core.snapshot()))
                continue
        except (EOFError, OSError):  # the server is gone
            return
        if core.busy:
            core.step()
        updates = core.take()
        if updates or core.busy:
            out.send(("step", updates, core.snapshot()))
