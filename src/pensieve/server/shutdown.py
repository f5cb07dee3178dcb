"""``pensieve serve``'s uvicorn server, whose graceful shutdown ends the turns still running.

On SIGINT or SIGTERM uvicorn stops accepting connections and waits up to
``timeout_graceful_shutdown`` seconds for the open ones to finish, then cancels their tasks.
Under load that cancels every streaming turn still queued: a ``CancelledError`` traceback each
in the log, and streams the clients see cut off mid-way. Here, once ``--shutdown-timeout`` has
passed, the server ends those turns itself: each stream gets an error event (``503``,
``shutting_down``) and ``[DONE]``, each non-streaming request a 503, the engine aborts them,
and their conversations stay as they were before the turn. uvicorn's own timeout comes
:data:`END_GRACE_S` later, as a backstop for a response that does not end.

SIGTERM and SIGINT shut down the same way: uvicorn catches both, drains, and then re-raises
the signal it caught; here both re-raise into a handler that does nothing, so ``serve``
goes on to stop the engine and close the store (its write-ahead log merged) and exits 0.
(Python's default SIGTERM handler would kill the process there, before the store is
closed.)

If the engine stops (its process killed, or its thread dead) or hangs (no progress for
``--watchdog-timeout`` seconds: :class:`~pensieve.server.async_engine.EngineClient`), the
server shuts down the same way and ``serve`` exits 1 so that a supervisor restarts it:
streams in flight have their error event, every completed turn is in the store, and the
restarted server continues each conversation from there (KV recomputed). The engine is not
restarted in place: a restart of the whole process brings every part back to a known state,
and a supervisor already counts and spaces restarts.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable
from typing import Any

import uvicorn

log = logging.getLogger("pensieve.server")

END_GRACE_S = 5.0
"""How long after ending the turns uvicorn still waits before cancelling what is left."""


ENGINE_CHECK_TICKS = 5
"""How often the server looks whether the engine still runs, in uvicorn's 0.1 s ticks."""


class GracefulServer(uvicorn.Server):
    """uvicorn's server; ``end_turns()`` (returns how many it ended) runs ``timeout_s`` into
    the graceful shutdown if connections are still open by then; once ``engine_alive()``
    is false it shuts down and sets :attr:`engine_died`."""

    def __init__(self, config: uvicorn.Config, end_turns: Callable[[], int],
                 timeout_s: float, engine_alive: Callable[[], bool] = lambda: True) -> None:
        super().__init__(config)
        self._end_turns = end_turns
        self._timeout_s = timeout_s
        self._engine_alive = engine_alive
        self.engine_died = False

    async def on_tick(self, counter: int) -> bool:
        if (counter % ENGINE_CHECK_TICKS == 0 and not self.should_exit
                and not self._engine_alive()):
            log.error("the engine stopped: the server shuts down and exits with status 1 so "
                      "that its supervisor restarts it (conversations continue from the "
                      "store, their KV recomputed)")
            self.engine_died = self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self._timeout_s, self._end)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _end(self) -> None:
        ended = self._end_turns()
        if ended:
            log.warning("shutdown timeout (%g s): ended %d turn(s) still running; their "
                        "conversations are as they were before them", self._timeout_s, ended)


def _after_drain(signum: int, frame: Any) -> None:
    """What uvicorn's re-raised SIGTERM or SIGINT runs once it has drained: nothing (the
    caller stops the engine and closes the store)."""


def run_server(app: Any, host: str, port: int, log_level: str, timeout_s: float,
               end_turns: Callable[[], int],
               engine_alive: Callable[[], bool] = lambda: True) -> int:
    """Serve ``app`` until SIGINT / SIGTERM (returns 0) or until the engine stops (returns
    1), shutting down as the module docstring says."""
    # h11 whatever else is installed (ray[serve] brings httptools): it hands requests with
    # odd header bytes (e.g. DEL in a value) to the app, which answers them with
    # OpenAI-shaped JSON errors, where httptools answers "Invalid HTTP request received." in
    # plain text before the app sees them
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http="h11",
                            timeout_graceful_shutdown=timeout_s + END_GRACE_S)
    signal.signal(signal.SIGTERM, _after_drain)
    signal.signal(signal.SIGINT, _after_drain)
    server = GracefulServer(config, end_turns, timeout_s, engine_alive)
    server.run()
    return 1 if server.engine_died else 0
