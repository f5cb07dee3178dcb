"""Benchmark harness on the CPU: arrival statistics, turn sequencing on virtual time, and the
metrics of a hand-made trace."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

import pytest

from pensieve.bench.engine_api import VirtualClock
from pensieve.bench.loadgen import LoadResult, RequestRecord, arrival_times, run_load
from pensieve.bench.metrics import capacity_at, percentile, summarize
from pensieve.bench.workload import Conversation, Turn
from pensieve.core.sampling_params import SamplingParams


def test_poisson_arrivals_have_the_asked_rate() -> None:
    ts = arrival_times(2.0, 5000.0, random.Random(1))
    assert abs(len(ts) / 5000.0 - 2.0) < 0.06
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    assert abs(statistics.mean(gaps) - 0.5) < 0.02
    # exponential: the standard deviation equals the mean
    assert abs(statistics.pstdev(gaps) - 0.5) < 0.03
    assert all(0 <= t < 5000 for t in ts) and ts == sorted(ts)
    with pytest.raises(ValueError):
        arrival_times(0.0, 1.0, random.Random(0))


@dataclass
class _Out:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str
    first_token_time: float
    finish_time: float
    cache_stats: dict[str, int]


class FakeEngine:
    """Finishes each request 0.01 s per output token after it was added, one at a time."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.queue: list[tuple[str, list[int], SamplingParams, str | None]] = []
        self.history: dict[str, int] = {}
        self.log: list[tuple[str, float]] = []

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, conversation_id: str | None = None,
                    ) -> None:
        assert arrival_time is not None and arrival_time <= self.clock.now() + 1e-9
        self.queue.append((request_id, prompt_token_ids, params, conversation_id))
        self.log.append((request_id, self.clock.now()))

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def step(self) -> list[_Out]:
        rid, ids, params, cid = self.queue.pop(0)
        start = self.clock.now()
        self.clock.advance(0.01 * params.max_tokens)
        ctx = self.history.get(cid or "", 0) + len(ids)
        self.history[cid or ""] = ctx + params.max_tokens
        return [_Out(rid, [0] * ctx, [1] * params.max_tokens, "length", start + 0.01,
                     self.clock.now(), {"new_prompt_tokens": len(ids)})]

    def cache_stats(self) -> dict[str, int]:
        return {}


def test_turns_follow_answers_plus_think_time() -> None:
    convs = [Conversation(f"x{i}", [Turn(5, 10), Turn(3, 20), Turn(2, 5)]) for i in range(3)]
    clock = VirtualClock()
    eng = FakeEngine(clock)
    res = run_load(eng, clock, convs, conv_rate=0.5, think_time_s=2.0, duration_s=40.0,
                   vocab_size=100, seed=3, drain_s=1000.0)
    assert res.unfinished == 0
    by_conv: dict[str, list[RequestRecord]] = {}
    for r in res.records:
        by_conv.setdefault(r.conversation, []).append(r)
    assert by_conv  # some conversations arrived in 40 s at 0.5/s
    for recs in by_conv.values():
        recs.sort(key=lambda r: r.turn)
        assert [r.turn for r in recs] == [0, 1, 2]
        assert [r.output_len for r in recs] == [10, 20, 5]
        for a, b in zip(recs, recs[1:]):
            assert b.sent > a.finished  # the next turn waits for the answer plus think time
        # the conversation's context grows by each turn's input and output
        assert [r.context_len for r in recs] == [5, 5 + 10 + 3, 5 + 10 + 3 + 20 + 2]
        assert all(math.isclose(r.latency, r.finished - r.sent) for r in recs)


def _rec(sent: float, lat: float | None, out: int, cache: dict[str, int] | None = None,
         ) -> RequestRecord:
    r = RequestRecord("c", 0, f"r{sent}", sent, 1, out, context_len=10,
                      first_token=sent + 0.1, cache=cache or {})
    r.finished = None if lat is None else sent + lat
    if lat is None:
        r.first_token = None
    return r


def test_metrics_of_a_hand_made_trace() -> None:
    recs = [_rec(0.5, 1.0, 10),  # before the warm-up: ignored
            _rec(1.0, 2.0, 10, {"gpu_hit_tokens": 6, "new_prompt_tokens": 4}),
            _rec(2.0, 4.0, 20, {"cpu_hit_tokens": 2, "recomputed_tokens": 2,
                                "new_prompt_tokens": 6}),
            _rec(3.0, 1.0, 5, {"new_prompt_tokens": 10}),
            _rec(4.0, None, 10)]  # never finished
    s = summarize(LoadResult(recs, duration_s=5.0, end_s=9.0, unfinished=1), warmup_s=1.0)
    assert s["requests"] == 4 and s["finished"] == 3
    assert s["throughput_rps"] == pytest.approx(3 / 4.0)
    assert s["output_tokens_per_s"] == pytest.approx(35 / 4.0)
    # normalized latencies 0.2, 0.2, 0.2, inf
    assert s["normalized_latency_s_p50"] == pytest.approx(0.2)
    assert s["normalized_latency_s_p90"] == math.inf
    assert s["latency_s_p50"] == pytest.approx(3.0)  # between 2 and 4
    assert s["gpu_hit_rate"] == pytest.approx(6 / 30)
    assert s["cpu_hit_rate"] == pytest.approx(2 / 30)
    assert s["recomputed_rate"] == pytest.approx(2 / 30)
    assert s["new_prompt_rate"] == pytest.approx(20 / 30)


def test_percentile_and_capacity() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 90) == 5
    assert math.isnan(percentile([], 50))
    pts = [{"throughput_rps": 1.0, "normalized_latency_s_p90": 0.05},
           {"throughput_rps": 2.0, "normalized_latency_s_p90": 0.10},
           {"throughput_rps": 3.0, "normalized_latency_s_p90": 0.30}]
    assert capacity_at(pts, 0.20) == pytest.approx(2.5)
    assert capacity_at(pts, 0.10) == pytest.approx(2.0)
    assert capacity_at(pts, 0.01) == 0.0
    assert capacity_at(pts, 1.0) == pytest.approx(3.0)
