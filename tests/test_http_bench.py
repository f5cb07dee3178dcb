"""The multi-turn load generator over the HTTP API: ``run_load`` drives a real ``pensieve serve``
(demo model, CPU) through :class:`HTTPEngine`: Pensieve's completions path (one server
conversation per benchmark conversation, later turns sending only their new tokens) and an
ordinary OpenAI chat client (the whole history re-sent each turn, recognised by the server)."""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import Server, run_cache
from transformers import AutoTokenizer

from pensieve.bench.engine_api import WallClock
from pensieve.bench.http_engine import CHAT_WORDS, HTTPEngine, parse_metrics, words_text
from pensieve.bench.loadgen import arrival_times, run_load
from pensieve.bench.run_metrics import summarize
from pensieve.bench.workload import Conversation, Turn, Workload
from pensieve.core.sampling_params import SamplingParams
from pensieve.engine.request_output import RequestOutput
from pensieve.models.demo import TOKENIZER_DIR
from pensieve.server.chat import ChatRenderer

VOCAB = 32000  # the demo model's
RATE, DURATION, SEED = 4.0, 1.0, 1  # four conversations arrive in the first second


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("http_bench")
    srv = Server(tmp / "conv.db", run_cache())
    yield srv
    srv.stop()


class _Recording:
    """Passes everything to the engine and keeps the outputs it returns."""

    def __init__(self, engine: HTTPEngine) -> None:
        self.engine = engine
        self.outputs: dict[str, RequestOutput] = {}

    def add_request(self, *a: object, **kw: object) -> None:
        self.engine.add_request(*a, **kw)  # type: ignore[arg-type]

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[RequestOutput]:
        outs = self.engine.step()
        self.outputs.update((o.request_id, o) for o in outs)
        return outs

    def cache_stats(self) -> dict[str, int]:
        return self.engine.cache_stats()

    def probe(self) -> dict[str, float]:
        return self.engine.probe()


def _workload(n: int) -> list[Conversation]:
    rng = random.Random(7)
    return [Conversation(f"conv{i}", [Turn(rng.randint(5, 20), rng.randint(3, 8))
                                      for _ in range(3)]) for i in range(n)]


def test_run_load_over_http(server: Server) -> None:
    n_convs = len(arrival_times(RATE, DURATION, random.Random(SEED)))
    assert n_convs == 4
    convs = _workload(n_convs)
    clock = WallClock()
    engine = HTTPEngine(server.url, clock=clock, max_workers=8)
    rec = _Recording(engine)
    try:
        res = run_load(rec, clock, convs, RATE, think_time_s=0.2, duration_s=DURATION,
                       vocab_size=VOCAB, seed=SEED, drain_s=40.0)
        assert res.unfinished == 0 and engine.errors == 0, engine.error_messages
        assert len(res.records) == 3 * n_convs
        assert not engine.has_unfinished()
        by_conv: dict[str, list] = {}
        for r in res.records:
            by_conv.setdefault(r.conversation, []).append(r)
        assert len(by_conv) == n_convs
        for name, recs in by_conv.items():
            recs.sort(key=lambda r: r.turn)
            conv = convs[int(name[1:]) % len(convs)]
            history = 0
            for r, turn in zip(recs, conv.turns):
                out = rec.outputs[r.request_id]
                assert out.finish_reason == "length"
                assert len(out.output_token_ids) == turn.output_len == r.output_len
                assert r.input_len == turn.input_len
                # the server prepended the conversation's history to the new tokens
                assert r.context_len == history + turn.input_len
                cache = r.cache
                assert sum(cache[k] for k in ("gpu_hit_tokens", "cpu_hit_tokens",
                                              "recomputed_tokens", "new_prompt_tokens")) \
                    == r.context_len
                if r.turn == 0:
                    assert cache["gpu_hit_tokens"] == 0
                else:  # the history's KV was kept (all but the last answer token's)
                    assert cache["gpu_hit_tokens"] == history - 1
                assert r.sent <= r.first_token <= r.finished
                history = r.context_len + turn.output_len
            assert [r.context_len for r in recs] == sorted(r.context_len for r in recs)
            assert recs[0].context_len < recs[1].context_len < recs[2].context_len
        totals = engine.cache_stats()
        assert totals["gpu_hit_tokens"] == sum(r.cache["gpu_hit_tokens"] for r in res.records)
        assert totals["gpu_hit_tokens"] > 0
        s = summarize(res)
        in_window = sum(r.sent < DURATION for r in res.records)  # turns sent while arriving
        assert s["finished"] == s["requests"] == in_window >= n_convs
        for k in ("latency_s", "normalized_latency_s", "ttft_s"):
            for q in (50, 90, 99):
                assert math.isfinite(s[f"{k}_p{q}"]) and s[f"{k}_p{q}"] >= 0
        assert s["gpu_hit_rate"] > 0.3

        # a failed request comes back finished as an error and is counted; a later turn of
        # the conversation it should have created fails too
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        engine.add_request("bad-0", [1, 10**9], params, conversation_id="broken")
        engine.add_request("bad-1", [1, 2], params, conversation_id="broken")
        got: list[RequestOutput] = []
        deadline = time.monotonic() + 30
        while engine.has_unfinished() and time.monotonic() < deadline:
            got += engine.step()
        assert sorted(o.request_id for o in got) == ["bad-0", "bad-1"]
        assert all(o.finish_reason == "error" and o.first_token_time is None for o in got)
        assert engine.errors == 2
    finally:
        engine.shutdown()
    # shutdown deleted the conversations the run created
    created = engine._created
    assert len(created) == n_convs
    for cid in created:
        assert httpx.get(f"{server.url}/v1/conversations/{cid}").status_code == 404


def test_multiturn_point_over_http(server: Server, tmp_path: Path, multiturn_module: Any,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``multiturn.py --engine http`` (what benchmarks/http_point.sh runs) records one point with
    the client's counters: no failed request, no turn held back on the client."""
    mt = multiturn_module
    monkeypatch.setattr(mt, "workload", lambda args: Workload("tiny", _workload(4)))
    rc = mt.main(["--engine", "http", "--url", server.url, "--systems", "pensieve",
                  "--rates", str(RATE), "--duration", str(DURATION), "--warmup", "0",
                  "--drain", "40", "--think-time", "0.2", "--max-connections", "8",
                  "--model", "demo", "--seed", str(SEED), "--out", str(tmp_path)])
    assert rc == 0
    (point,) = [json.loads(line) for line in (tmp_path / "points.jsonl").open()]
    assert point["engine"] == "http" and point["system"] == "pensieve"
    assert point["batching"] is None
    assert point["unfinished"] == 0 and point["errors"] == 0 and point["http_errors"] == 0
    assert point["http_throttled"] == 0 and point["max_connections"] == 8
    assert 1 <= point["http_peak_in_flight"] <= 4  # one turn per conversation at a time
    assert point["finished"] == point["requests"] > 0
    assert point["gpu_hit_rate"] > 0.3 and point["normalized_latency_s_p90"] is not None
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").open()]
    assert len(records) == 3 * 4 and not any(r["error"] for r in records)


# ---------------------------------------------------------------------- the chat client
class _RecordingTransport(httpx.AsyncBaseTransport):
    """Passes requests on and keeps the JSON bodies of chat completions."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.bodies: list[dict] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/chat/completions"):
            self.bodies.append(json.loads(request.content))
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


class _RecordingHTTPEngine(HTTPEngine):
    async def _open(self) -> httpx.AsyncClient:
        self.transport = _RecordingTransport()
        return httpx.AsyncClient(base_url=self.base_url, timeout=self._timeout,
                                 transport=self.transport)


class _ChatRecording(_Recording):
    """Also keeps, per finished turn, the token ids the server stored for its conversation
    (context + answer): read before the load generator sends the conversation's next turn."""

    def __init__(self, engine: HTTPEngine, url: str) -> None:
        super().__init__(engine)
        self.url = url
        self.stored: dict[str, list[int]] = {}

    def step(self) -> list[RequestOutput]:
        outs = super().step()
        for o in outs:
            cid = self.engine._chat_ids[o.conversation_id]
            conv = httpx.get(f"{self.url}/v1/conversations/{cid}").json()
            self.stored[o.request_id] = conv["token_ids"]
        return outs


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_chat_words_are_one_token_each() -> None:
    from transformers import AutoTokenizer

    from pensieve.models.demo import TOKENIZER_DIR

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    assert len(set(CHAT_WORDS)) == len(CHAT_WORDS) >= 400
    ids = list(range(0, 300 * 97, 97))
    text = words_text(ids)
    assert len(text.split()) == 300
    assert len(tok.encode("x " + text, add_special_tokens=False)) == 301
    assert words_text(ids, tokens_per_word=2.0).split() == text.split()[:150]


def test_parse_metrics() -> None:
    text = """# HELP pensieve_requests_running Requests
pensieve_requests_running 3.0
pensieve_requests_waiting 1.0
pensieve_blocks_used{tier="gpu"} 120.0
pensieve_blocks_used{tier="cpu"} 7.0
pensieve_blocks_total{tier="gpu"} 1310.0
pensieve_blocks_total{tier="cpu"} 3604.0
pensieve_swap_bytes_total{direction="in"} 3.69e+10
pensieve_swap_bytes_total{direction="out"} 6.65e+10
pensieve_dropped_tokens_total 66421.0
pensieve_prompt_tokens_total{source="new"} 5.0
"""
    assert parse_metrics(text) == {
        "requests_running": 3, "requests_waiting": 1, "gpu_blocks_used": 120,
        "cpu_blocks_used": 7, "gpu_blocks_total": 1310, "cpu_blocks_total": 3604,
        "swap_in_bytes": 3.69e10, "swap_out_bytes": 6.65e10, "dropped_tokens": 66421}
    vllm = ('vllm:num_requests_running{model_name="m"} 4.0\n'
            'vllm:num_requests_waiting{model_name="m"} 0.0\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n')
    assert parse_metrics(vllm) == {"requests_running": 4, "requests_waiting": 0,
                                   "gpu_cache_usage": 0.25}


def test_chat_client_over_http(server: Server) -> None:
    """An ordinary OpenAI chat client: the whole history each turn, nothing Pensieve-specific
    in the body; the server recognises the history and serves it from its KV cache."""
    convs = _workload(4)
    clock = WallClock()
    engine = _RecordingHTTPEngine(server.url, clock=clock, max_workers=8, api="chat",
                                  metrics_interval_s=0.2)
    rec = _ChatRecording(engine, server.url)
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(str(TOKENIZER_DIR)))
    try:
        assert engine.tokens_per_word == pytest.approx(1.0, abs=0.02)  # calibrated
        # ... and the calibration's two conversations are gone again (the earlier tests
        # deleted theirs): no KV held
        deadline = time.monotonic() + 5
        while server.metric('pensieve_blocks_used{tier="gpu"}') and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.metric('pensieve_blocks_used{tier="gpu"}') == 0
        assert engine.model == "pensieve-demo"  # the server's first model
        res = run_load(rec, clock, convs, RATE, think_time_s=0.2, duration_s=DURATION,
                       vocab_size=VOCAB, seed=SEED, drain_s=60.0, sample_interval_s=0.5)
        assert res.unfinished == 0 and engine.errors == 0, engine.error_messages
        assert engine.history_misses == 0
        n_convs = len({r.conversation for r in res.records})
        assert n_convs == 4 and len(res.records) == 12
        # the requests: ordinary OpenAI chat bodies, the history re-sent verbatim
        bodies = [b for b in engine.transport.bodies if b.get("stream")]
        assert len(bodies) == 12
        body_of = {(b["messages"][0]["content"], len(b["messages"])): b for b in bodies}
        by_conv: dict[str, list] = {}
        for r in res.records:
            by_conv.setdefault(r.conversation, []).append(r)
        full_reuse = 0
        for recs in by_conv.values():
            recs.sort(key=lambda r: r.turn)
            bench_cid = rec.outputs[recs[0].request_id].conversation_id
            first_user = engine._chats[bench_cid][0]["content"]
            prev_ctx = prev_out = 0
            prev_ids: list[int] = []
            for r in recs:
                out = rec.outputs[r.request_id]
                assert out.finish_reason == "length"
                assert r.output_tokens == r.output_len  # ignore_eos: exactly max_tokens
                history = prev_ctx + prev_out
                # the new turn adds its words (one token each) plus the template's few tokens
                assert r.input_len <= r.context_len - history <= r.input_len + 12
                # the model was fed exactly the chat template of the messages sent
                ids = rec.stored[r.request_id]
                assert len(ids) == r.context_len + r.output_tokens
                msgs = body_of[(first_user, 2 * r.turn + 1)]["messages"]
                assert ids[:r.context_len] == renderer.render(msgs, add_generation_prompt=True)
                c = r.cache
                if r.turn == 0:
                    assert c["gpu_hit_tokens"] == 0
                else:
                    # The history's KV is kept up to its first token that differs from the
                    # template's rendering (never the last answer token's: it was never fed).
                    # The template writes " {answer}</s>\n": an answer whose first token has
                    # no leading space, or whose text re-tokenizes differently, diverges there.
                    keep = _common_prefix_len(prev_ids, ids[:r.context_len])
                    assert prev_ctx <= keep  # the previous turn's context is always kept
                    assert c["gpu_hit_tokens"] == min(keep, history - 1)
                    full_reuse += c["gpu_hit_tokens"] == history - 1
                assert c["new_prompt_tokens"] + c["gpu_hit_tokens"] == r.context_len
                assert r.sent <= r.first_token <= r.finished
                prev_ctx, prev_out, prev_ids = r.context_len, r.output_tokens, ids
        assert full_reuse > 0  # answers that re-render to their own tokens are reused whole
        for b in bodies:
            assert set(b) == {"model", "messages", "max_tokens", "temperature", "stream",
                              "stream_options", "ignore_eos"}
            assert b["stream_options"] == {"include_usage": True} and b["ignore_eos"] is True
            roles = [m["role"] for m in b["messages"]]
            assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]
        longest = {}
        for b in bodies:
            first = b["messages"][0]["content"]
            if len(b["messages"]) > len(longest.get(first, [])):
                longest[first] = b["messages"]
        assert len(longest) == 4 and all(len(m) == 5 for m in longest.values())
        # the assistant messages are exactly what the server stored for the conversation
        created = list(engine._created)
        stored = [httpx.get(f"{server.url}/v1/conversations/{cid}").json()["messages"]
                  for cid in created]
        by_first = {m[0]["content"]: m for m in stored}
        for first, msgs in longest.items():
            assert by_first[first][:5] == msgs
        # the time series: the client's sessions and the server's /metrics
        assert res.samples and all("gpu_blocks_used" in s for s in res.samples[2:])
        assert max(s["sessions_in_flight"] for s in res.samples) >= 1
        assert all(s["gpu_blocks_total"] == 96 and s["cpu_blocks_total"] == 64
                   for s in res.samples if "gpu_blocks_total" in s)
        s = summarize(res)
        assert s["prefill_cached_tokens"] > 0 and s["prefill_computed_tokens"] > 0
        assert s["prefill_cached_tokens"] + s["prefill_computed_tokens"] == sum(
            r.context_len for r in res.records if r.sent < DURATION)  # the window's
        assert "steady" in s
    finally:
        engine.shutdown()
    # one per turn: each re-sent history is a new conversation over the last one's KV (the
    # calibration's were deleted at once)
    assert len(created) == len(set(created)) == 12
    for cid in created:  # deleted at shutdown
        assert httpx.get(f"{server.url}/v1/conversations/{cid}").status_code == 404

    # without ignore_eos the body has none, and the answer may end early
    plain = _RecordingHTTPEngine(server.url, api="chat", ignore_eos=False, calibrate=False,
                                 metrics_interval_s=None)
    try:
        params = SamplingParams(max_tokens=5, temperature=0.0)
        plain.add_request("one", [1, 2, 3], params, conversation_id="solo")
        got: list[RequestOutput] = []
        deadline = time.monotonic() + 30
        while plain.has_unfinished() and time.monotonic() < deadline:
            got += plain.step()
        assert len(got) == 1 and got[0].finish_reason in ("length", "stop")
        assert 1 <= len(got[0].output_token_ids) <= 5
        (body,) = plain.transport.bodies
        assert "ignore_eos" not in body and body["messages"] == [
            {"role": "user", "content": words_text([1, 2, 3])}]
        assert plain.probe() == {}
    finally:
        plain.shutdown()


def test_multiturn_chat_point_over_http(server: Server, tmp_path: Path, multiturn_module: Any,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``multiturn.py --engine http --api chat`` (what benchmarks/churn_points.sh runs): the
    point, its steady-state summary and its time series."""
    mt = multiturn_module
    monkeypatch.setattr(mt, "workload", lambda args: Workload("tiny", _workload(4)))
    rc = mt.main(["--engine", "http", "--api", "chat", "--url", server.url,
                  "--systems", "pensieve", "--rates", str(RATE), "--duration", "3",
                  "--warmup", "1", "--drain", "60", "--think-time", "0.2",
                  "--max-connections", "8", "--model", "demo", "--seed", str(SEED),
                  "--sample-interval", "0.25", "--out", str(tmp_path)])
    assert rc == 0
    (point,) = [json.loads(line) for line in (tmp_path / "points.jsonl").open()]
    assert point["api"] == "chat" and point["workload"] == "tiny"
    assert point["http_errors"] == 0 and point["http_history_misses"] == 0
    assert point["tokens_per_word"] == pytest.approx(1.0, abs=0.02) and point["ignore_eos"]
    assert point["unfinished"] == 0 and point["finished"] == point["requests"] > 0
    assert point["prefill_cached_tokens"] > 0 and point["prompt_tokens_per_s"] > 0
    assert point["steady_state"] in (True, False)
    st = point["steady"]
    assert st["samples"][0] > 0 and st["samples"][1] > 0
    assert {"sessions_in_flight", "gpu_blocks_used", "requests_running"} <= set(st["halves"])
    (series,) = [json.loads(line) for line in (tmp_path / "timeseries.jsonl").open()]
    assert series["system"] == "pensieve" and series["warmup_s"] == 1.0
    assert series["duration_s"] == 3.0 and len(series["samples"]) >= 8
    assert "gpu_blocks_used" in series["samples"][-1]


def test_chat_client_reads_lines_on_newlines_only_and_error_events(server: Server) -> None:
    """SSE lines split on ``\\n`` only (a U+2028 inside the JSON stays text), CRLF accepted;
    an error event fails the request with the server's message."""

    def sse(*objs: object) -> bytes:
        return "".join(f"data: {json.dumps(o, ensure_ascii=False)}\r\n\r\n"
                       for o in objs).encode() + b"data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        user = json.loads(request.content)["messages"][-1]["content"]
        if user == words_text([2]):
            body = sse({"choices": [{"delta": {"content": "half"}, "finish_reason": None}]},
                       {"error": {"message": "the engine failed on this request",
                                  "type": "server_error", "code": "engine_error"}})
        else:
            body = sse({"choices": [{"delta": {"content": "a\u2028b\x85c"},
                                     "finish_reason": None}]},
                       {"choices": [{"delta": {}, "finish_reason": "length"}]},
                       {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}})
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    class Mocked(HTTPEngine):
        async def _open(self) -> httpx.AsyncClient:
            return httpx.AsyncClient(base_url=self.base_url,
                                     transport=httpx.MockTransport(handler))

    engine = Mocked(server.url, api="chat", calibrate=False, metrics_interval_s=None)
    try:
        params = SamplingParams(max_tokens=2, temperature=0.0)
        engine.add_request("ok", [1], params, conversation_id="a")
        engine.add_request("bad", [2], params, conversation_id="b")
        got: dict[str, RequestOutput] = {}
        deadline = time.monotonic() + 30
        while engine.has_unfinished() and time.monotonic() < deadline:
            got |= {o.request_id: o for o in engine.step()}
        assert got["ok"].finish_reason == "length" and len(got["ok"].output_token_ids) == 2
        assert engine._chats["a"][-1] == {"role": "assistant", "content": "a\u2028b\x85c"}
        assert got["bad"].finish_reason == "error" and engine.errors == 1
        assert "engine_error" in engine.error_messages[0]
    finally:
        engine.shutdown()
