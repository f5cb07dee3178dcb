"""The benchmark's system under test over HTTP: a server behind an OpenAI-compatible API.

:class:`HTTPEngine` implements :class:`~pensieve.bench.engine_api.BenchEngine` in one of two
ways (``api``):

``"chat"`` -- an ordinary OpenAI chat client, the way users run a stateful server. Each turn is
a streaming ``POST /v1/chat/completions`` that re-sends the conversation's whole ``messages``
history (user and assistant messages alternating; each assistant message is exactly the text
the server streamed back for it) followed by the new user message, with ``stream: true``,
``stream_options: {include_usage: true}`` and ``max_tokens`` = the turn's answer length. With
``ignore_eos`` (on by default; vLLM and Pensieve accept it, other servers may reject it, so it
can be turned off) a dummy-weight model generates exactly that many tokens. No conversation id
or other Pensieve field is sent: ``pensieve serve`` recognises the re-sent history by hash and
reuses the conversation's KV. Token counts come from ``usage`` (``prompt_tokens``,
``completion_tokens``, and ``prompt_tokens_details.cached_tokens`` where the server reports it);
Pensieve's own per-turn cache stats (``pensieve.cache`` in the last chunk) are read if present.
Pensieve's ``conversation_id`` in the chunks, if present, is only watched (each turn that
re-sends a history is a new server conversation over the last one's KV, and each is deleted
at the end): a later turn of a benchmark conversation whose cache stats show nothing of its
history (no hit, nothing recomputed: it was not recognised) is counted in
``history_misses``.

The user text of a turn is one word of :data:`~pensieve.bench.http_wire.CHAT_WORDS` per prompt
token id the load generator drew (:func:`~pensieve.bench.http_wire.words_text`), so every
system sees the same texts for the same seed. With ``calibrate`` the client first measures the
served tokenizer: two one-token requests of 64 and 320 words give the prompt tokens per word
from ``usage``, and a turn of ``n`` tokens then sends ``round(n / tokens_per_word)`` words
(``tokens_per_word`` records it); a Pensieve server's conversations of those two requests are
deleted at once. Whatever the calibration, the points report what ``usage`` counted.

``"completions"`` -- Pensieve's token-id path: each turn is a streaming ``POST /v1/completions``
with the token ids as the prompt. A benchmark conversation's first turn asks the server to
create a conversation (``create_conversation``); later turns name the server's id and send
only their new tokens, so the server prepends the history and reuses whatever KV it kept.

Concurrency: the requests run as coroutines of one asyncio event loop in a background thread
(``httpx.AsyncClient``). The load generator is open-loop, and under overload hundreds of turns
are in flight at once; with a thread per request, a pool smaller than that would hold turns
back on the client and hide the server's queueing (and a pool as large costs a thread and a
stack per stream). A coroutine per request costs little, the loop reads every stream as its
bytes arrive, and the main thread (the load generator) only touches a thread-safe queue.
``max_workers`` caps the concurrent requests (and connections); a request that had to wait for
a slot is counted in ``throttled``, so a run whose client was the bottleneck can be spotted.

Server state: with ``metrics_interval_s`` the loop also scrapes the server's Prometheus
``/metrics`` that often (:class:`~pensieve.bench.http_probe.MetricsScraper`) and
:meth:`HTTPEngine.probe` returns the latest values.

Timing on the given clock and token counts: a streamed turn is assembled by
:class:`~pensieve.bench.http_wire.StreamedTurn`. ``first_token_time`` is the arrival of the first
SSE data line. The server sends a stream's first chunk (its empty "role" chunk) only once the
first token has been sampled -- it awaits the first token before it starts the response (vLLM
does the same) -- so that line marks the first token even when the token decodes to no text.
``finish_time`` is the arrival of the chunk with ``finish_reason``. Outputs hold dummy token ids
of the ``usage`` lengths.

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
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import httpx

from pensieve.bench.engine_api import Clock, WallClock
from pensieve.bench.http_probe import MetricsScraper, parse_metrics
from pensieve.bench.http_wire import CHAT_WORDS, StreamedTurn, StreamFailed, sse_lines, words_text
from pensieve.core.sampling_params import SamplingParams
from pensieve.engine.request_output import RequestOutput

log = logging.getLogger("pensieve.bench")

_STEP_WAIT_S = 0.01

_CALIBRATION_WORDS = (64, 320)


HISTORY_SOURCES = ("gpu_hit_tokens", "cpu_hit_tokens", "disk_hit_tokens", "recomputed_tokens")
"""Where a recognised history's KV comes from (Pensieve's per-turn cache stats)."""


class HTTPEngine:
    """Drives a server through its OpenAI-compatible API (``/v1/chat/completions`` as an
    ordinary chat client, or Pensieve's ``/v1/completions`` with token ids)."""

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None,
                 max_workers: int = 64, clock: Clock | None = None,
                 timeout_s: float | None = None, delete_conversations: bool = True,
                 api: str = "completions", ignore_eos: bool = True, calibrate: bool = True,
                 metrics_interval_s: float | None = 1.0) -> None:
        """``timeout_s`` bounds the wait for each chunk (default: none; the load generator's
        drain limit ends a run). With ``delete_conversations``, :meth:`shutdown` deletes the
        conversations this engine created on a Pensieve server (their ids come back in the
        responses), so the next point starts from an empty cache. ``model``: the ``model``
        field of each request (default: the first model the server lists, else
        ``"pensieve"``). ``api``, ``ignore_eos``, ``calibrate``, ``metrics_interval_s``: see
        the module doc."""
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if api not in ("completions", "chat"):
            raise ValueError(f"api must be 'completions' or 'chat', got {api!r}")
        self.base_url = base_url.rstrip("/")
        self.api = api
        self.ignore_eos = ignore_eos
        self.max_workers = max_workers
        self.clock: Clock = clock if clock is not None else WallClock()
        self.delete_conversations = delete_conversations
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = httpx.Timeout(timeout_s, connect=30.0, pool=None)
        r = httpx.get(self.base_url + "/health", timeout=10)  # fail early: no server
        r.raise_for_status()
        self.model = model or self._first_model() or "pensieve"

        self.errors = 0
        """Requests that failed (returned with ``finish_reason="error"``)."""
        self.error_messages: list[str] = []
        """The first few failures, for the log."""
        self.throttled = 0
        """Requests that waited for one of the ``max_workers`` slots."""
        self.peak_in_flight = 0
        self.history_misses = 0
        """Chat: later turns that the server put in a new conversation (history not found)."""
        self.tokens_per_word: float = 1.0
        """Chat: prompt tokens per word of :data:`CHAT_WORDS`, measured by ``calibrate``."""
        self._in_flight = 0  # in the loop thread
        self._pending = 0  # added and not yet returned by step() (main thread only)
        self._done: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self._server_ids: dict[str, concurrent.futures.Future[str | None]] = {}
        self._created: list[str] = []
        self._chats: dict[str, list[dict[str, str]]] = {}  # chat histories (loop thread)
        self._chat_ids: dict[str, str] = {}  # bench conversation -> server id seen (loop)
        self._totals: dict[str, int] = {}
        self._lock = threading.Lock()
        self._tasks: set[asyncio.Task[None]] = set()  # in the loop thread
        self._closed = False
        self.metrics_interval_s = metrics_interval_s
        self._metrics: MetricsScraper | None = None

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="pensieve-http-bench",
                                        daemon=True)
        self._thread.start()
        self._client: httpx.AsyncClient = self._call(self._open())
        self._slots: asyncio.Semaphore = self._call(self._make_semaphore())
        if api == "chat" and calibrate:
            self.tokens_per_word = self._call(self._calibrate(), timeout=300)
        self._scraper: concurrent.futures.Future[None] | None = None
        if metrics_interval_s:
            self._metrics = MetricsScraper(self.base_url, self._headers, metrics_interval_s,
                                           self.clock)
            self._scraper = asyncio.run_coroutine_threadsafe(self._metrics.run(), self._loop)

    def _first_model(self) -> str | None:
        try:
            r = httpx.get(self.base_url + "/v1/models", headers=self._headers, timeout=10)
            data = r.json().get("data") if r.status_code == 200 else None
            return str(data[0]["id"]) if data else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError):
            return None

    # ------------------------------------------------------------------ BenchEngine
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None,
                    conversation_id: str | None = None) -> None:
        if self._closed:
            raise RuntimeError("engine is shut down")
        arrival = self.clock.now() if arrival_time is None else arrival_time
        if self.api == "chat":
            self._pending += 1
            asyncio.run_coroutine_threadsafe(
                self._chat_request(request_id, list(prompt_token_ids), params, arrival,
                                   conversation_id), self._loop)
            return
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

    def probe(self) -> dict[str, float]:
        """The server's state at the latest ``/metrics`` scrape (empty before the first or
        without one), with ``probe_age_s``: how old that scrape is."""
        return self._metrics.probe() if self._metrics is not None else {}

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
        if self._scraper is not None:
            self._scraper.cancel()
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

    async def _calibrate(self) -> float:
        """Prompt tokens per word of :data:`CHAT_WORDS` on this server (from ``usage``)."""
        counts = []
        for n in _CALIBRATION_WORDS:
            text = " ".join(CHAT_WORDS[(7 * i + n) % len(CHAT_WORDS)] for i in range(n))
            body: dict[str, Any] = {"model": self.model, "max_tokens": 1, "temperature": 0.0,
                                    "messages": [{"role": "user", "content": text}]}
            if self.ignore_eos:
                body["ignore_eos"] = True
            r = await self._client.post("/v1/chat/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"calibration request failed: HTTP {r.status_code}: "
                                   f"{r.text[:300]}")
            doc = r.json()
            counts.append(int(doc["usage"]["prompt_tokens"]))
            if doc.get("conversation_id"):  # Pensieve kept it: not part of the load
                await self._delete(str(doc["conversation_id"]))
        per_word = (counts[1] - counts[0]) / (_CALIBRATION_WORDS[1] - _CALIBRATION_WORDS[0])
        if not 0.25 <= per_word <= 8:
            log.warning("calibration: %.3f tokens per word is implausible; using 1", per_word)
            return 1.0
        log.info("calibration: %.3f prompt tokens per word", per_word)
        return float(per_word)

    def _fail(self, rid: str, e: Exception, arrival: float, bench_cid: str | None,
              ids: list[int]) -> RequestOutput:
        msg = f"{rid}: {type(e).__name__}: {e}"
        self.errors += 1
        if len(self.error_messages) < 10:
            self.error_messages.append(msg)
            log.warning("request failed: %s", msg)
        return RequestOutput(rid, list(ids), [], "error", arrival_time=arrival,
                             first_token_time=None, finish_time=self.clock.now(),
                             conversation_id=bench_cid)

    def _add_totals(self, cache: dict[str, int]) -> None:
        with self._lock:
            for k, v in cache.items():
                self._totals[k] = self._totals.get(k, 0) + int(v)

    async def _stream(self, path: str, body: dict[str, Any]
                      ) -> AsyncGenerator[tuple[float, dict[str, Any]], None]:
        """POST ``body`` to ``path`` as a streaming request within the connection cap; yields
        (arrival time on the clock, parsed chunk) for each SSE data line up to ``[DONE]``.
        Raises :class:`StreamFailed` on a non-200 answer or an error event (``data: {"error":
        ...}``, what a server sends when it fails a request mid-stream)."""
        if self._slots.locked():
            self.throttled += 1
        async with self._slots:
            self._in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
            try:
                async with self._client.stream("POST", path, json=body) as resp:
                    if resp.status_code != 200:
                        detail = (await resp.aread()).decode(errors="replace")[:300]
                        raise StreamFailed(f"HTTP {resp.status_code}: {detail}")
                    async for line in sse_lines(resp.aiter_text()):
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip(" ")
                        if data == "[DONE]":
                            break
                        now = self.clock.now()
                        chunk = json.loads(data)
                        if isinstance(chunk, dict) and chunk.get("error"):
                            raise StreamFailed(f"error event: {chunk['error']}"[:300])
                        yield now, chunk
            finally:
                self._in_flight -= 1

    async def _chat_request(self, rid: str, ids: list[int], params: SamplingParams,
                            arrival: float, bench_cid: str | None) -> None:
        """One turn as an ordinary OpenAI chat client sends it: the whole history again."""
        history = self._chats.get(bench_cid, []) if bench_cid is not None else []
        user = {"role": "user", "content": words_text(ids, self.tokens_per_word)}
        body: dict[str, Any] = {
            "model": self.model, "messages": history + [user],
            "max_tokens": params.max_tokens, "temperature": params.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
        if params.top_p != 1.0:
            body["top_p"] = params.top_p
        if params.seed is not None:
            body["seed"] = params.seed
        if self.ignore_eos:
            body["ignore_eos"] = True
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        turn = StreamedTurn(chat=True)
        try:
            async with aclosing(self._stream("/v1/chat/completions", body)) as chunks:
                async for now, chunk in chunks:
                    turn.feed(now, chunk)
            if turn.finish_reason is None:
                raise StreamFailed("the stream ended without a finish_reason")
            out = turn.output(rid, ids, arrival, bench_cid)
            if bench_cid is not None:
                self._chats[bench_cid] = history + [
                    user, {"role": "assistant", "content": "".join(turn.parts)}]
                server_cid = turn.server_cid
                if server_cid is not None:
                    prev = self._chat_ids.get(bench_cid)
                    if prev != server_cid:
                        self._created.append(server_cid)
                    if prev is not None and out.cache_stats is not None and not any(
                            out.cache_stats.get(k, 0) for k in HISTORY_SOURCES):
                        self.history_misses += 1
                    self._chat_ids[bench_cid] = server_cid
            if out.cache_stats:
                self._add_totals(out.cache_stats)
        except (StreamFailed, httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            out = self._fail(rid, e, arrival, bench_cid, ids)
        finally:
            self._tasks.discard(task)
        self._done.put(out)

    async def _request(self, rid: str, ids: list[int], params: SamplingParams, arrival: float,
                       bench_cid: str | None, first_turn: bool,
                       server_id: concurrent.futures.Future[str | None] | None) -> None:
        body: dict[str, Any] = {
            "model": self.model, "prompt": ids, "max_tokens": params.max_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
            "ignore_eos": params.ignore_eos and self.ignore_eos, "stream": True,
            "stream_options": {"include_usage": True}}
        if params.seed is not None:
            body["seed"] = params.seed
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        turn = StreamedTurn(chat=False)
        try:
            if server_id is not None:
                if first_turn:
                    body["create_conversation"] = True
                else:
                    sid = await asyncio.wrap_future(server_id)
                    if sid is None:
                        raise StreamFailed(f"conversation {bench_cid!r} was never created "
                                           "(its first turn failed)")
                    body["conversation_id"] = sid
            async with aclosing(self._stream("/v1/completions", body)) as chunks:
                async for now, chunk in chunks:
                    sid = chunk.get("conversation_id")
                    if first_turn and sid and server_id is not None and not server_id.done():
                        server_id.set_result(sid)
                        self._created.append(sid)
                    turn.feed(now, chunk)
            if turn.finish_reason is None:
                raise StreamFailed("the stream ended without a finish_reason")
            if first_turn and server_id is not None and not server_id.done():
                raise StreamFailed("the server sent no conversation_id")
            out = turn.output(rid, ids, arrival, bench_cid)
            if out.cache_stats:
                self._add_totals(out.cache_stats)
        except (StreamFailed, httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            out = self._fail(rid, e, arrival, bench_cid, ids)
        finally:
            self._tasks.discard(task)
            if first_turn and server_id is not None and not server_id.done():
                server_id.set_result(None)
        self._done.put(out)


# CHAT_WORDS, words_text (.http_wire) and parse_metrics (.http_probe): re-exported
__all__ = ["CHAT_WORDS", "HTTPEngine", "parse_metrics", "words_text"]
