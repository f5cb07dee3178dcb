"""The benchmark's system under test over HTTP: a running ``pensieve serve`` (the real path).

:class:`HTTPEngine` implements :class:`~pensieve.bench.engine_api.BenchEngine` by sending each
turn as a streaming ``POST /v1/completions`` with the token ids as the prompt. A benchmark
conversation's first turn asks the server to create a conversation (``create_conversation``);
later turns name the server's id and send only their new tokens, so the server prepends the
history and reuses whatever KV it kept -- exactly what a stateful client of the API does.

Concurrency: the requests run as coroutines of one asyncio event loop in a background thread
(``httpx.AsyncClient``). The load generator is open-loop, and under overload hundreds of turns
are in flight at once; with a thread per request, a pool smaller than that would hold turns
back on the client and hide the server's queueing (and a pool as large costs a thread and a
stack per stream). A coroutine per request costs little, the loop reads every stream as its
bytes arrive, and the main thread (the load generator) only touches a thread-safe queue.
``max_workers`` caps the concurrent requests (and connections); a request that had to wait for
a slot is counted in ``throttled``, so a run whose client was the bottleneck can be spotted.

Timing on the given clock: ``first_token_time`` is the arrival of the first SSE data line. The
server sends a stream's first chunk (its empty "role" chunk) only once the first token has been
sampled -- it awaits the first token before it starts the response -- so that line marks the
first token even when the token decodes to no text. ``finish_time`` is the arrival of the chunk
with ``finish_reason``. The request asks for ``stream_options.include_usage``; the usage chunk
gives the context length (``prompt_tokens``: the whole history plus the new tokens) and the
completion tokens, and the final chunk carries the turn's cache stats (``pensieve.cache``).
Outputs hold dummy token ids of those lengths.

A request that fails (non-200 status, a broken stream, no ``finish_reason``) is returned as a
finished output with ``finish_reason="error"`` and no first-token time (so it counts as
infinitely slow in TTFT percentiles), and is counted in ``errors``; later turns of its
conversation fail too if the conversation was never created.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import queue
import threading
from typing import Any

import httpx

from pensieve.bench.engine_api import Clock, WallClock
from pensieve.core.sampling_params import SamplingParams
from pensieve.engine.outputs import RequestOutput

log = logging.getLogger("pensieve.bench")

_STEP_WAIT_S = 0.01


class _Failed(Exception):
    pass


class HTTPEngine:
    """Drives a Pensieve server through its OpenAI-compatible ``/v1/completions``."""

    def __init__(self, base_url: str, api_key: str | None = None, model: str = "pensieve",
                 max_workers: int = 64, clock: Clock | None = None,
                 timeout_s: float | None = None, delete_conversations: bool = True) -> None:
        """``timeout_s`` bounds the wait for each chunk (default: none; the load generator's
        drain limit ends a run). With ``delete_conversations``, :meth:`shutdown` deletes the
        conversations this engine created, so the next point starts from an empty cache."""
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.max_workers = max_workers
        self.clock: Clock = clock if clock is not None else WallClock()
        self.delete_conversations = delete_conversations
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = httpx.Timeout(timeout_s, connect=30.0, pool=None)
        r = httpx.get(self.base_url + "/health", timeout=10)  # fail early: no server
        r.raise_for_status()

        self.errors = 0
        """Requests that failed (returned with ``finish_reason="error"``)."""
        self.error_messages: list[str] = []
        """The first few failures, for the log."""
        self.throttled = 0
        """Requests that waited for one of the ``max_workers`` slots."""
        self.peak_in_flight = 0
        self._in_flight = 0  # in the loop thread
        self._pending = 0  # added and not yet returned by step() (main thread only)
        self._done: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self._server_ids: dict[str, concurrent.futures.Future[str | None]] = {}
        self._created: list[str] = []
        self._totals: dict[str, int] = {}
        self._lock = threading.Lock()
        self._tasks: set[asyncio.Task[None]] = set()  # in the loop thread
        self._closed = False

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="pensieve-http-bench",
                                        daemon=True)
        self._thread.start()
        self._client: httpx.AsyncClient = self._call(self._open())
        self._slots: asyncio.Semaphore = self._call(self._make_semaphore())

    # ------------------------------------------------------------------ BenchEngine
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None,
                    conversation_id: str | None = None) -> None:
        if self._closed:
            raise RuntimeError("engine is shut down")
        arrival = self.clock.now() if arrival_time is None else arrival_time
        first_turn, server_id = False, None
        if conversation_id is not None:
            server_id = self._server_ids.get(conversation_id)
            if server_id is None:  # a conversation not seen yet: this turn creates it
                first_turn = True
                server_id = self._server_ids[conversation_id] = concurrent.futures.Future()
        self._pending += 1
        asyncio.run_coroutine_threadsafe(
            self._request(request_id, list(prompt_token_ids), params, arrival, conversation_id,
                          first_turn, server_id), self._loop)

    def has_unfinished(self) -> bool:
        return self._pending > 0

    def step(self) -> list[RequestOutput]:
        """The requests finished since the last call (waits up to 10 ms for the first)."""
        if self._pending == 0:
            return []
        out: list[RequestOutput] = []
        try:
            out.append(self._done.get(timeout=_STEP_WAIT_S))
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            pass
        self._pending -= len(out)
        return out

    def cache_stats(self) -> dict[str, int]:
        """Per-request cache stats summed over the finished requests seen so far."""
        with self._lock:
            return dict(self._totals)

    def shutdown(self) -> None:
        """Cancel what is still in flight, delete the conversations created (unless told not
        to), close the client and stop the loop thread."""
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._close(), timeout=120)
        except Exception as e:  # noqa: BLE001 - shutting down regardless
            log.warning("HTTP engine shutdown: %s", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if self.errors:
            log.warning("%d request(s) failed; first: %s", self.errors,
                        "; ".join(self.error_messages[:3]))

    # ------------------------------------------------------------------ the loop thread
    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()
        self._loop.close()

    def _call(self, coro: Any, timeout: float | None = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _open(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=self.max_workers,
                              max_keepalive_connections=self.max_workers)
        return httpx.AsyncClient(base_url=self.base_url, headers=self._headers,
                                 timeout=self._timeout, limits=limits)

    async def _make_semaphore(self) -> asyncio.Semaphore:
        return asyncio.Semaphore(self.max_workers)

    async def _close(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # streams closed: server aborts
        if self.delete_conversations and self._created:
            await asyncio.gather(*(self._delete(cid) for cid in self._created))
        await self._client.aclose()

    async def _delete(self, cid: str) -> None:
        """Delete one conversation; an aborted turn may still be winding down (409): retry."""
        for attempt in range(20):
            try:
                async with self._slots:
                    r = await self._client.delete(f"/v1/conversations/{cid}")
            except httpx.HTTPError as e:
                log.warning("could not delete conversation %s: %s", cid, e)
                return
            if r.status_code != 409:
                return
            await asyncio.sleep(0.05 * (attempt + 1))

    async def _request(self, rid: str, ids: list[int], params: SamplingParams, arrival: float,
                       bench_cid: str | None, first_turn: bool,
                       server_id: concurrent.futures.Future[str | None] | None) -> None:
        body: dict[str, Any] = {
            "model": self.model, "prompt": ids, "max_tokens": params.max_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
            "ignore_eos": params.ignore_eos, "stream": True,
            "stream_options": {"include_usage": True}}
        if params.seed is not None:
            body["seed"] = params.seed
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        first_t: float | None = None
        finish_t: float | None = None
        finish_reason: str | None = None
        cache: dict[str, int] | None = None
        usage: dict[str, Any] | None = None
        text_chunks = 0
        try:
            if server_id is not None:
                if first_turn:
                    body["create_conversation"] = True
                else:
                    sid = await asyncio.wrap_future(server_id)
                    if sid is None:
                        raise _Failed(f"conversation {bench_cid!r} was never created "
                                      "(its first turn failed)")
                    body["conversation_id"] = sid
            if self._slots.locked():
                self.throttled += 1
            async with self._slots:
                self._in_flight += 1
                self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
                try:
                    async with self._client.stream("POST", "/v1/completions",
                                                   json=body) as resp:
                        if resp.status_code != 200:
                            detail = (await resp.aread()).decode(errors="replace")[:300]
                            raise _Failed(f"HTTP {resp.status_code}: {detail}")
                        async for line in resp.aiter_lines():
                            if not line.startswith("data:"):
                                continue
                            data = line[5:].strip()
                            if data == "[DONE]":
                                break
                            now = self.clock.now()
                            if first_t is None:
                                first_t = now  # sent once the first token is sampled
                            chunk = json.loads(data)
                            sid = chunk.get("conversation_id")
                            if first_turn and sid and server_id is not None \
                                    and not server_id.done():
                                server_id.set_result(sid)
                                self._created.append(sid)
                            if chunk.get("usage"):
                                usage = chunk["usage"]
                            for choice in chunk.get("choices") or ():
                                text_chunks += bool(choice.get("text"))
                                if choice.get("finish_reason"):
                                    finish_reason = choice["finish_reason"]
                                    finish_t = now
                                    cache = (chunk.get("pensieve") or {}).get("cache")
                finally:
                    self._in_flight -= 1
            if finish_reason is None:
                raise _Failed("the stream ended without a finish_reason")
            if first_turn and server_id is not None and not server_id.done():
                raise _Failed("the server sent no conversation_id")
            prompt_len = int(usage["prompt_tokens"]) if usage else len(ids)
            n_out = int(usage["completion_tokens"]) if usage else text_chunks
            out = RequestOutput(rid, [0] * prompt_len, [0] * n_out, finish_reason,
                                arrival_time=arrival, first_token_time=first_t,
                                finish_time=finish_t, conversation_id=bench_cid,
                                cache_stats=dict(cache) if cache else None)
            if cache:
                with self._lock:
                    for k, v in cache.items():
                        self._totals[k] = self._totals.get(k, 0) + int(v)
        except (_Failed, httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            msg = f"{rid}: {type(e).__name__}: {e}"
            self.errors += 1
            if len(self.error_messages) < 10:
                self.error_messages.append(msg)
                log.warning("request failed: %s", msg)
            out = RequestOutput(rid, list(ids), [], "error", arrival_time=arrival,
                                first_token_time=None, finish_time=self.clock.now(),
                                conversation_id=bench_cid)
        finally:
            self._tasks.discard(task)
            if first_turn and server_id is not None and not server_id.done():
                server_id.set_result(None)
        self._done.put(out)


__all__ = ["HTTPEngine"]
