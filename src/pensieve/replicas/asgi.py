"""Run one HTTP request through an ASGI app in process and stream back what it sends.

A replica receives a request as plain values from the ingress (a Ray call, not HTTP) and
feeds it to the server's FastAPI app. The messages come back as picklable values: first
``("start", status, headers)``, then the body's chunks as ``bytes``. When the caller stops
reading (its client went away), the app sees ``http.disconnect``, as under uvicorn, and aborts
the turn. :func:`with_request_key` hands the app the key the ingress gave the request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

Headers = list[tuple[bytes, bytes]]

REQUEST_KEY_HEADER = b"x-pensieve-request-key"
"""The header that carries a request's key from the ingress to its replica (the same on the
ingress's retries of the request)."""


def with_request_key(app: Any) -> Any:
    """``app``, serving each request with :data:`pensieve.server.turns.request_key` set to its
    :data:`REQUEST_KEY_HEADER` (so the turn it completes is stored with the key)."""
    from pensieve.server.turns import request_key  # the replica's server (not the ingress's)

    async def keyed(scope: dict[str, Any], receive: Any, send: Any) -> None:
        key = dict(scope.get("headers") or ()).get(REQUEST_KEY_HEADER, b"")
        token = request_key.set(key.decode("latin-1"))
        try:
            await app(scope, receive, send)
        finally:
            request_key.reset(token)

    return keyed


async def call_asgi(app: Any, method: str, path: str, query: bytes, headers: Headers,
                    body: bytes, extra_headers: Sequence[tuple[bytes, bytes]] = ()
                    ) -> AsyncIterator[Any]:
    """Yield ``("start", status, headers)`` then the body chunks of ``app``'s response."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": query, "root_path": "", "headers": list(headers),
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}
    out: asyncio.Queue[Any] = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            await out.put(("start", msg["status"],
                           list(msg.get("headers") or ()) + list(extra_headers)))
        elif msg["type"] == "http.response.body":
            if msg.get("body"):
                await out.put(bytes(msg["body"]))
            if not msg.get("more_body"):
                await out.put(None)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await out.put(None)

    task = asyncio.create_task(run())
    try:
        while (item := await out.get()) is not None:
            yield item
    finally:
        gone.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), 30)
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
