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
Pensieve's ``conversation_id`` in the chunks, if present, is only watched: a later turn of a
benchmark conversation that lands in another server conversation (its history was not
recognised) is counted in ``history_misses``.

The user text of a turn is words from :data:`CHAT_WORDS` (common English words that are one
token each in Llama/Mistral-class 32k SentencePiece vocabularies), one per prompt token id the
load generator drew (``word = CHAT_WORDS[id % len]``), so every system sees the same texts for
the same seed. With ``calibrate`` the client first measures the served tokenizer: two one-token
requests of 64 and 320 words give the prompt tokens per word from ``usage``, and a turn of
``n`` tokens then sends ``round(n / tokens_per_word)`` words (``tokens_per_word`` records it);
a Pensieve server's conversations of those two requests are deleted at once.
Whatever the calibration, the points report what ``usage`` counted.

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
``/metrics`` that often (its own connection, never held back by the request slots) and
:meth:`HTTPEngine.probe` returns the latest values: Pensieve's ``pensieve_blocks_used`` /
``pensieve_blocks_total`` per tier, ``pensieve_requests_running`` / ``_waiting``, swap bytes and
dropped tokens; vLLM's ``vllm:num_requests_running`` / ``_waiting`` and KV cache usage. A server
without ``/metrics`` is simply not scraped.

Timing on the given clock: ``first_token_time`` is the arrival of the first SSE data line. The
server sends a stream's first chunk (its empty "role" chunk) only once the first token has been
sampled -- it awaits the first token before it starts the response (vLLM does the same) -- so
that line marks the first token even when the token decodes to no text. ``finish_time`` is the
arrival of the chunk with ``finish_reason``. Outputs hold dummy token ids of the ``usage``
lengths.

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
import re
import threading
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import httpx

from pensieve.bench.engine_api import Clock, WallClock
from pensieve.core.sampling_params import SamplingParams
from pensieve.engine.outputs import RequestOutput

log = logging.getLogger("pensieve.bench")

_STEP_WAIT_S = 0.01

_WORDS = """
    the of and to in is that for it as with was on be by this are from at or an have not which
    but they one all were there can has more will their if about would when what so out up
    into than them some could other only new time these two may then do first any like now my
    over such our even most made after also did many before must through back years where much
    your way well down should because each just those people how too little state good very
    make world still own see men work long get here between both life being under never day
    same another know while last might great old year off come since against go came right
    used take three states himself few house use during without again place around however
    home small found thought went say part once general high upon school every does got left
    number course until always away something fact though water less public put think almost
    hand enough far took head yet government system better set told nothing night end why
    called find look asked later point knew city next program business give group toward young
    days let room side social given present several order national possible rather second face
    per among form important often things looked early white case become large big need four
    within felt along children saw best ever least power development light thing seemed family
    interest want members mind country area others done turn although open service certain
    kind problem began different door thus help sense means whole matter perhaps itself times
    law human line above name example action company hands local show whether five history
    gave today either act feet across taken past quite anything seen having experience body
    word half really field am car words already themselves information tell college shall
    money period held keep sure probably free seems real behind cannot question air office
    making brought whose special heard major problems ago became moment study available known
    result street economic position reason change south board individual job society areas
    west close turned community true court force full seem future age wanted department voice
    center woman control common necessary following front sometimes six clear further land run
    students provide feel party able music education university child effect level stood short
    town morning total figure rate art class private file code test function value error
    output input data table query user server request response model build check update list
    tool call search read write memory
"""
CHAT_WORDS: tuple[str, ...] = tuple(_WORDS.split())
"""Common English words, each one token after a space in the demo model's tokenizer (Mistral's
32k SentencePiece vocabulary; Llama 2's is of the same kind): a turn's user text."""

_CALIBRATION_WORDS = (64, 320)

# Prometheus series read from /metrics: (name, label value or None) -> probe key
_SCRAPE = {
    ("pensieve_blocks_used", "gpu"): "gpu_blocks_used",
    ("pensieve_blocks_used", "cpu"): "cpu_blocks_used",
    ("pensieve_blocks_total", "gpu"): "gpu_blocks_total",
    ("pensieve_blocks_total", "cpu"): "cpu_blocks_total",
    ("pensieve_requests_running", None): "requests_running",
    ("pensieve_requests_waiting", None): "requests_waiting",
    ("pensieve_swap_bytes_total", "in"): "swap_in_bytes",
    ("pensieve_swap_bytes_total", "out"): "swap_out_bytes",
    ("pensieve_dropped_tokens_total", None): "dropped_tokens",
    ("vllm:num_requests_running", None): "requests_running",
    ("vllm:num_requests_waiting", None): "requests_waiting",
    ("vllm:gpu_cache_usage_perc", None): "gpu_cache_usage",
    ("vllm:kv_cache_usage_perc", None): "gpu_cache_usage",
}
_LINE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)')


def parse_metrics(text: str) -> dict[str, float]:
    """The probe values found in a Prometheus text exposition (see the module doc)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        name, labels, value = m.groups()
        label = None
        if labels:
            lm = re.search(r'(?:tier|direction)="([^"]*)"', labels)
            label = lm.group(1) if lm else None
        key = _SCRAPE.get((name, label)) or _SCRAPE.get((name, None))
        if key is None:
            continue
        try:
            v = float(value)
        except ValueError:
            continue
        out[key] = out.get(key, 0.0) + v if name.startswith("vllm:num") else v
    return out


async def sse_lines(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The lines of an SSE stream, split on ``\n`` only (a trailing ``\r`` dropped). httpx's
    ``aiter_lines`` splits as ``str.splitlines`` does, also on U+0085, U+2028 and U+2029,
    which a server may leave unescaped inside a data line's JSON."""
    buf = ""
    async for text in chunks:
        buf += text
        *lines, buf = buf.split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if buf:
        yield buf


def words_text(ids: list[int], tokens_per_word: float = 1.0) -> str:
    """User text of about ``len(ids)`` tokens: one word of :data:`CHAT_WORDS` per id, the
    number of words scaled by ``1 / tokens_per_word``."""
    n = max(1, round(len(ids) / tokens_per_word)) if ids else 1
    src = ids or [0]
    return " ".join(CHAT_WORDS[src[i % len(src)] % len(CHAT_WORDS)] for i in range(n))


class _Failed(Exception):
    pass


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
        self._probe: dict[str, float] = {}
        self._probe_t: float | None = None
        self.metrics_interval_s = metrics_interval_s

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
            self._scraper = asyncio.run_coroutine_threadsafe(self._scrape_loop(), self._loop)

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
        out = dict(self._probe)
        if out and self._probe_t is not None:
            out["probe_age_s"] = round(self.clock.now() - self._probe_t, 3)
        return out

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

    async def _scrape_loop(self) -> None:
        assert self.metrics_interval_s
        async with httpx.AsyncClient(base_url=self.base_url, headers=self._headers,
                                     timeout=httpx.Timeout(10.0)) as client:
            while True:
                try:
                    r = await client.get("/metrics")
                    if r.status_code == 404:
                        log.info("the server has no /metrics: not scraping")
                        return
                    if r.status_code == 200:
                        self._probe = parse_metrics(r.text)
                        self._probe_t = self.clock.now()
                except httpx.HTTPError as e:
                    log.debug("metrics scrape failed: %s", e)
                await asyncio.sleep(self.metrics_interval_s)

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
                      ) -> AsyncIterator[tuple[float, dict[str, Any]]]:
        """POST ``body`` to ``path`` as a streaming request within the connection cap; yields
        (arrival time on the clock, parsed chunk) for each SSE data line up to ``[DONE]``.
        Raises :class:`_Failed` on a non-200 answer or an error event (``data: {"error": ...}``,
        what a server sends when it fails a request mid-stream)."""
        if self._slots.locked():
            self.throttled += 1
        async with self._slots:
            self._in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
            try:
                async with self._client.stream("POST", path, json=body) as resp:
                    if resp.status_code != 200:
                        detail = (await resp.aread()).decode(errors="replace")[:300]
                        raise _Failed(f"HTTP {resp.status_code}: {detail}")
                    async for line in sse_lines(resp.aiter_text()):
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip(" ")
                        if data == "[DONE]":
                            break
                        now = self.clock.now()
                        chunk = json.loads(data)
                        if isinstance(chunk, dict) and chunk.get("error"):
                            raise _Failed(f"error event: {chunk['error']}"[:300])
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
        first_t: float | None = None
        finish_t: float | None = None
        finish_reason: str | None = None
        cache: dict[str, int] = {}
        usage: dict[str, Any] | None = None
        server_cid: str | None = None
        parts: list[str] = []
        try:
            async with aclosing(self._stream("/v1/chat/completions", body)) as chunks:
                async for now, chunk in chunks:
                    if first_t is None:
                        first_t = now  # sent once the first token is sampled
                    server_cid = chunk.get("conversation_id") or server_cid
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices") or ():
                        delta = choice.get("delta") or {}
                        if delta.get("content"):
                            parts.append(delta["content"])
                        if choice.get("finish_reason"):
                            finish_reason = choice["finish_reason"]
                            finish_t = now
                            cache = dict((chunk.get("pensieve") or {}).get("cache") or {})
            if finish_reason is None:
                raise _Failed("the stream ended without a finish_reason")
            if usage is None:
                raise _Failed("the stream had no usage chunk (stream_options.include_usage)")
            prompt_len = int(usage["prompt_tokens"])
            n_out = int(usage["completion_tokens"])
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            if cached is not None:
                cache["usage_cached_tokens"] = int(cached)
            if bench_cid is not None:
                self._chats[bench_cid] = history + [
                    user, {"role": "assistant", "content": "".join(parts)}]
                if server_cid is not None:
                    prev = self._chat_ids.get(bench_cid)
                    if prev is None:
                        self._created.append(server_cid)
                    elif prev != server_cid:
                        self.history_misses += 1
                        self._created.append(server_cid)
                    self._chat_ids[bench_cid] = server_cid
            out = RequestOutput(rid, [0] * prompt_len, [0] * n_out, finish_reason,
                                arrival_time=arrival, first_token_time=first_t,
                                finish_time=finish_t, conversation_id=bench_cid,
                                cache_stats=cache or None)
            if cache:
                self._add_totals(cache)
        except (_Failed, httpx.HTTPError, ValueError, KeyError, TypeError) as e:
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
            async with aclosing(self._stream("/v1/completions", body)) as chunks:
                async for now, chunk in chunks:
                    if first_t is None:
                        first_t = now  # sent once the first token is sampled
                    sid = chunk.get("conversation_id")
                    if first_turn and sid and server_id is not None and not server_id.done():
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
            if finish_reason is None:
                raise _Failed("the stream ended without a finish_reason")
            if first_turn and server_id is not None and not server_id.done():
                raise _Failed("the server sent no conversation_id")
            prompt_len = int(usage["prompt_tokens"]) if usage else len(ids)
            n_out = int(usage["completion_tokens"]) if usage else text_chunks
            cache = dict(cache) if cache else {}
            cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
            if cached is not None:
                cache["usage_cached_tokens"] = int(cached)
            out = RequestOutput(rid, [0] * prompt_len, [0] * n_out, finish_reason,
                                arrival_time=arrival, first_token_time=first_t,
                                finish_time=finish_t, conversation_id=bench_cid,
                                cache_stats=cache or None)
            if cache:
                self._add_totals(cache)
        except (_Failed, httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            out = self._fail(rid, e, arrival, bench_cid, ids)
        finally:
            self._tasks.discard(task)
            if first_turn and server_id is not None and not server_id.done():
                server_id.set_result(None)
        self._done.put(out)


__all__ = ["CHAT_WORDS", "HTTPEngine", "parse_metrics", "words_text"]
