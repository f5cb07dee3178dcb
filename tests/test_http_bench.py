"""The multi-turn load generator over the HTTP API: ``run_load`` drives a real ``pensieve serve``
(demo model, CPU) through :class:`HTTPEngine`, one server conversation per benchmark
conversation, later turns sending only their new tokens."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_util import Server

from pensieve.bench.engine_api import WallClock
from pensieve.bench.http_engine import HTTPEngine
from pensieve.bench.loadgen import arrival_times, run_load
from pensieve.bench.metrics import summarize
from pensieve.bench.workload import Conversation, Turn, Workload
from pensieve.core.sampling_params import SamplingParams
from pensieve.engine.outputs import RequestOutput

VOCAB = 32000  # the demo model's
RATE, DURATION, SEED = 4.0, 1.0, 1  # four conversations arrive in the first second


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("http_bench")
    srv = Server(tmp / "conv.db", tmp / "cache")
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


def _multiturn_module():  # noqa: ANN202 - benchmarks/multiturn.py, a script
    if "multiturn_bench" not in sys.modules:
        script = Path(__file__).resolve().parents[1] / "benchmarks" / "multiturn.py"
        spec = importlib.util.spec_from_file_location("multiturn_bench", script)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["multiturn_bench"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["multiturn_bench"]


def test_multiturn_point_over_http(server: Server, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``multiturn.py --engine http`` (what benchmarks/h200_http.sh runs) records one point with
    the client's counters: no failed request, no turn held back on the client."""
    mt = _multiturn_module()
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
