"""``pensieve serve``'s uvicorn server, whose graceful shutdown ends the turns still running.

On SIGINT or SIGTERM uvicorn stops accepting connections and waits up to
``timeout_graceful_shutdown`` seconds for the open ones to finish, then cancels their tasks.
Under load that cancels every streaming turn still queued: a ``CancelledError`` traceback each
in the log, and streams the clients see cut off mid-way. Here, once ``--shutdown-timeout`` has
passed, the server ends those turns itself: each stream gets an error event (``503``,
``shutting_down``) and ``[DONE]``, each non-streaming request a 503, the engine aborts them,
and their conversations stay as they were before the turn. uvicorn's own timeout comes
:data:`END_GRACE_S` later, as a backstop for a response that does not end.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

import uvicorn

log = logging.getLogger("pensieve.server")

END_GRACE_S = 5.0
"""How long after ending the turns uvicorn still waits before cancelling what is left."""


class GracefulServer(uvicorn.Server):
    """uvicorn's server; ``end_turns()`` (returns how many it ended) runs ``timeout_s`` into
    the graceful shutdown if connections are still open by then."""

    def __init__(self, config: uvicorn.Config, end_turns: Callable[[], int],
                 timeout_s: float) -> None:
        super().__init__(config)
        self._end_turns = end_turns
        self._timeout_s = timeout_s

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


def run_server(app: Any, host: str, port: int, log_level: str, timeout_s: float,
               end_turns: Callable[[], int]) -> None:
    """Serve ``app`` until SIGINT / SIGTERM, then shut down as the module docstring says."""
    # h11 whatever else is installed (ray[serve] brings httptools): it hands requests with
    # odd header bytes (e.g. DEL in a value) to the app, which answers them with
    # OpenAI-shaped JSON errors, where httptools answers "Invalid HTTP request received." in
    # plain text before the app sees them
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http="h11",
                            timeout_graceful_shutdown=timeout_s + END_GRACE_S)
    GracefulServer(config, end_turns, timeout_s).run()
