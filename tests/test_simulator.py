"""The simulator: step features, the step-cost model and its fit, and SimEngine driving the real
scheduler and tiered cache on a virtual clock under every cache policy."""

from __future__ import annotations

import heapq
import json
import random
import subprocess
import sys

import numpy as np
import pytest

from pensieve.bench.engine_api import VirtualClock
from pensieve.core.cost_model import CostModel
from pensieve.core.eviction import POLICIES
from pensieve.core.outputs import QueryRange, ScheduledRequest, SchedulerOutput, SwapPlan
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.scheduling_config import SchedulerConfig
from pensieve.sim.simulator import SimEngine
from pensieve.sim.step_cost import (
    COEFFICIENTS,
    StepCostModel,
    StepFeatures,
    features_of,
    fit,
    nnls,
    relative_errors,
)

# ------------------------------------------------------------------------------- features


def _sched() -> SchedulerOutput:
    p = SamplingParams(max_tokens=4)
    a = ScheduledRequest("a", [0, 1], [QueryRange(0, [7] * 4), QueryRange(10, [7] * 3)],
                         sample=True, sampling_params=p, num_output_tokens=0)
    b = ScheduledRequest("b", [2, 3, 4], [QueryRange(20, [5])], sample=True,
                         sampling_params=p, num_output_tokens=3)
    swaps = SwapPlan(swap_out_first=[(1, 2)], swap_in=[(3, 4), (5, 6)],
                     swap_out=[(7, 8), (9, 10), (11, 12)])
    return SchedulerOutput([a, b], swaps)


def test_features_exact() -> None:
    f = features_of(_sched())
    assert f.num_prefill_tokens == 7
    assert f.num_decode_tokens == 1
    assert f.num_requests == 2
    # causal pairs: 1+2+3+4 = 10; 11+12+13 = 36; 21
    assert f.attn_pairs == 67.0
    assert f.kv_read_tokens == 4 + 13 + 21
    assert (f.swap_in_chunks, f.swap_out_chunks, f.urgent_swap_out_chunks) == (2, 4, 1)
    brute = sum(p + 1 for s in _sched().requests for r in s.ranges
                for p in range(r.start_pos, r.end_pos))
    assert f.attn_pairs == brute
    assert StepFeatures.from_dict(f.to_dict()) == f
    assert features_of(SchedulerOutput([])) == StepFeatures()


def test_predict_formula() -> None:
    f = features_of(_sched())
    m = StepCostModel(base_s=1.0, per_request_s=0.1, per_prefill_token_s=0.01,
                      per_decode_token_s=0.02, per_attn_pair_s=1e-3, per_kv_read_token_s=1e-4,
                      per_swap_chunk_s=0.5)
    compute = 1.0 + 0.2 + 0.07 + 0.02 + 0.067 + 0.0038
    assert m.compute_time(f) == pytest.approx(compute)
    assert m.predict(f) == pytest.approx(compute + 0.5 * 6)
    # overlap: urgent copies exposed in full, the other 5 chunks only beyond the compute
    slow = StepCostModel(base_s=1.0, swap_copy_chunk_s=0.4)
    assert slow.predict(f) == pytest.approx(1.0 + 0.4 + (5 * 0.4 - 1.0))
    fast = StepCostModel(base_s=1.0, swap_copy_chunk_s=0.1)
    assert fast.predict(f) == pytest.approx(1.0 + 0.1)
    with pytest.raises(ValueError):
        StepCostModel(base_s=-1.0)


# ------------------------------------------------------------------------------- fitting


def _random_features(rng: random.Random) -> StepFeatures:
    n_dec = rng.randrange(0, 64)
    n_pre = rng.choice([0, 0, rng.randrange(2, 2048)])
    reqs = n_dec + (rng.randrange(1, 4) if n_pre else 0) or 1
    swap_in, swap_out = rng.choice([(0, 0), (rng.randrange(0, 40), rng.randrange(0, 40))])
    return StepFeatures(
        num_prefill_tokens=n_pre, num_decode_tokens=n_dec, num_requests=reqs,
        attn_pairs=float(n_pre * rng.randrange(0, 8000) + n_dec * rng.randrange(1, 8000)),
        kv_read_tokens=rng.randrange(1, 200_000), swap_in_chunks=swap_in,
        swap_out_chunks=swap_out, urgent_swap_out_chunks=rng.randrange(0, swap_out + 1),
    )


TRUE = StepCostModel(base_s=4e-3, per_prefill_step_s=9e-3, per_request_s=2e-5,
                     per_prefill_token_s=4e-5,
                     per_decode_token_s=6e-5, per_attn_pair_s=3e-10, per_kv_read_token_s=2e-8,
                     per_swap_chunk_s=1e-5)


def test_fit_recovers_known_coefficients() -> None:
    rng = random.Random(0)
    records = [(f, TRUE.predict(f)) for f in (_random_features(rng) for _ in range(300))]
    for relative in (True, False):
        m = fit(records, relative=relative)
        assert m.source == "fit" and m.fit_num_records == 300
        for name in COEFFICIENTS:
            assert getattr(m, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
        assert m.fit_median_rel_err is not None and m.fit_median_rel_err < 1e-9
        assert m.fit_p90_rel_err is not None and m.fit_p90_rel_err < 1e-9


def test_fit_with_copy_overlap_recovers() -> None:
    true = StepCostModel(**TRUE.coefficients, swap_copy_chunk_s=3e-4)
    rng = random.Random(1)
    records = [(f, true.predict(f)) for f in (_random_features(rng) for _ in range(300))]
    assert any(true.exposed_copy_time(f) > 3e-4 * f.urgent_swap_out_chunks for f, _ in records)
    m = StepCostModel.fit(records, swap_copy_chunk_s=3e-4)
    for name in COEFFICIENTS:
        assert getattr(m, name) == pytest.approx(getattr(true, name), rel=1e-5), name
    assert relative_errors(m, records)["max"] < 1e-8


def test_fit_keeps_coefficients_non_negative_and_reports_error() -> None:
    rng = random.Random(2)
    # decode-only steps whose time *falls* with kv reads: least squares would go negative
    records = []
    for _ in range(100):
        n = rng.randrange(1, 64)
        f = StepFeatures(num_decode_tokens=n, num_requests=n, kv_read_tokens=n * 100)
        records.append((f, 0.01 + 1e-4 * n * (1 + 0.05 * rng.random())))
    m = fit(records)
    assert all(v >= 0 for v in m.coefficients.values())
    err = relative_errors(m, records)
    assert err["median"] == pytest.approx(m.fit_median_rel_err)
    assert 0 <= err["median"] <= err["p90"] <= err["max"] < 0.05
    with pytest.raises(ValueError):
        fit([])
    with pytest.raises(ValueError):
        fit([(StepFeatures(), 0.0)])


def test_nnls_active_set_kkt() -> None:
    from pensieve.sim.step_cost import _nnls_active_set

    rng = np.random.default_rng(0)
    for _ in range(20):
        a = rng.normal(size=(30, 6))
        b = rng.normal(size=30)
        x = _nnls_active_set(a, b)
        grad = a.T @ (b - a @ x)
        assert (x >= 0).all()
        assert np.all(grad <= 1e-9)  # no improving direction into the feasible set
        assert np.allclose(grad[x > 0], 0, atol=1e-9)
        assert np.allclose(x, nnls(a, b), atol=1e-8)


def test_save_load_roundtrip(tmp_path) -> None:  # noqa: ANN001
    rng = random.Random(3)
    m = fit([(f, TRUE.predict(f)) for f in (_random_features(rng) for _ in range(50))],
            label="synthetic")
    p = tmp_path / "sub" / "step_cost.json"
    m.save(p)
    assert json.loads(p.read_text())["format"] == "pensieve-step-cost"
    assert StepCostModel.load(p) == m
    assert StepCostModel.from_dict(m.to_dict()) == m
    with pytest.raises(ValueError):
        StepCostModel.from_dict({**m.to_dict(), "bogus": 1})


def test_analytic_prior() -> None:
    m = StepCostModel.analytic(num_params=1e9, num_layers=10, num_heads=8, num_kv_heads=2,
                               head_dim=64, chunk_size=32, dtype_bytes=2, flops_per_s=1e12,
                               hbm_bytes_per_s=1e11, pcie_bytes_per_s=1e10)
    assert m.source == "analytic" and "analytic prior" in m.label
    assert m.base_s == pytest.approx(2e9 / 1e11)
    assert m.per_prefill_token_s == m.per_decode_token_s == pytest.approx(2e9 / 1e12)
    assert m.per_attn_pair_s == pytest.approx(4 * 8 * 64 * 10 / 1e12)
    kv_token = 2 * 10 * 2 * 64 * 2
    assert m.per_kv_read_token_s == pytest.approx(kv_token / 1e11)
    assert m.swap_copy_chunk_s == pytest.approx(32 * kv_token / 1e10)
    assert m.per_request_s == 0 and m.per_swap_chunk_s == 0


# ------------------------------------------------------------------------------- SimEngine

CHUNK = 8
TIERS = {"num_gpu_blocks": 24, "num_cpu_blocks": 6}  # 192 GPU-tier tokens, 48 CPU-tier
COST = CostModel.analytic(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                          head_dim=16, intermediate_size=128, chunk_size=CHUNK)
STEP = StepCostModel.analytic(num_params=13e9, num_layers=40, num_heads=40, num_kv_heads=10,
                              head_dim=128, chunk_size=CHUNK)


def make_sim(policy: str, clock: VirtualClock) -> SimEngine:
    sim = SimEngine(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8,
                                    max_model_len=512),
                    TIERS["num_gpu_blocks"], TIERS["num_cpu_blocks"], STEP, clock, COST,
                    chunk_size=CHUNK, cache_policy=policy, block_bytes=1000, vocab_size=256)
    sim.audit = True
    return sim


def drive(sim: SimEngine, clock: VirtualClock, seed: int = 0, num_convs: int = 5,
          turns: int = 4) -> dict[str, list]:
    """Conversations start staggered; each next turn follows the answer after a think time."""
    rng = random.Random(seed)
    plan = {f"c{c}": [(rng.randrange(3, 14), rng.randrange(2, 9)) for _ in range(turns)]
            for c in range(num_convs)}
    heap = [(0.05 * i, cid, 0) for i, cid in enumerate(plan)]
    heapq.heapify(heap)
    history: dict[str, list[int]] = {cid: [] for cid in plan}
    outs: dict[str, list] = {cid: [] for cid in plan}
    expect: dict[str, tuple[list[int], int]] = {}
    in_flight = 0
    last = clock.now()
    while heap or in_flight:
        while heap and heap[0][0] <= clock.now():
            _, cid, k = heapq.heappop(heap)
            n_in, n_out = plan[cid][k]
            ids = [rng.randrange(1, 256) for _ in range(n_in)]
            rid = f"{cid}-t{k}"
            expect[rid] = (history[cid] + ids, n_out)
            sim.add_request(rid, ids, SamplingParams(max_tokens=n_out, ignore_eos=True),
                            conversation_id=cid)
            in_flight += 1
        if not in_flight:
            clock.sleep_until(heap[0][0])
            continue
        before = clock.now()
        done = sim.step()
        assert clock.now() > before >= last  # each step costs time; never back
        last = clock.now()
        sim.cache.check_integrity()
        for out in done:
            in_flight -= 1
            cid, k = out.conversation_id, int(out.request_id.rsplit("t", 1)[1])
            context, n_out = expect.pop(out.request_id)
            assert out.prompt_token_ids == context
            assert len(out.output_token_ids) == n_out and out.finish_reason == "length"
            assert out.arrival_time <= out.first_token_time <= out.finish_time == clock.now()
            history[cid] = context + out.output_token_ids
            assert sim.conversation_history(cid) == history[cid]
            outs[cid].append(out)
            if k + 1 < turns:
                heapq.heappush(heap, (clock.now() + rng.expovariate(1 / 0.5), cid, k + 1))
    assert not expect and not sim.has_unfinished()
    return outs


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_sim_multi_turn_all_policies(policy: str) -> None:
    clock = VirtualClock()
    sim = make_sim(policy, clock)
    outs = drive(sim, clock)
    assert all(len(v) == 4 for v in outs.values())
    later = [o.cache_stats for v in outs.values() for o in v[1:]]
    if policy == "stateless":
        assert all(s["recomputed_tokens"] > 0 and s["gpu_hit_tokens"] == 0 for s in later)
    else:
        assert sum(s["gpu_hit_tokens"] for s in later) > 0
    starts = sim.executor.step_start_times
    assert starts == sorted(starts) and len(starts) == len(sim.executor.step_log) == sim.num_steps
    assert sum(dt for _, dt in sim.executor.step_log) == pytest.approx(sim.executor.busy_time_s)
    assert all(dt > 0 for _, dt in sim.executor.step_log)
    stats = sim.cache_stats()
    assert stats["gpu_blocks_total"] == TIERS["num_gpu_blocks"]
    log = sim.executor.step_log
    assert stats["swap_out_bytes"] == 1000 * sum(f.swap_out_chunks for f, _ in log)
    if POLICIES[policy].uses_cpu_tier:
        assert stats["cpu_blocks_total"] == TIERS["num_cpu_blocks"]
        assert stats["swapped_out_tokens"] > 0  # the tiny tiers force the CPU tier into use
    else:
        assert stats["cpu_blocks_total"] == 0 and stats["swapped_out_tokens"] == 0


def test_sim_pensieve_beats_stateless_in_virtual_time() -> None:
    """Pensieve recomputes less and so spends less virtual time on the work of its steps. The
    steps' fixed part (``base_s`` each) is left out: in a run this small it is most of the
    time, and the step count moves by a step or two with how turns interleave (a turn whose
    history is swapped in starts a step later than one that recomputes it)."""
    work = {}
    recomputed = {}
    for policy in ("pensieve", "stateless"):
        clock = VirtualClock()
        sim = make_sim(policy, clock)
        drive(sim, clock, seed=7)
        work[policy] = sim.executor.busy_time_s - STEP.base_s * len(sim.executor.step_log)
        recomputed[policy] = sim.cache_stats()["recomputed_tokens"]
    assert recomputed["pensieve"] < recomputed["stateless"]
    assert work["pensieve"] < work["stateless"]


def test_sim_step_log_refits_the_model() -> None:
    clock = VirtualClock()
    sim = make_sim("pensieve", clock)
    drive(sim, clock, seed=3)
    m = StepCostModel.fit(sim.executor.step_log, swap_copy_chunk_s=STEP.swap_copy_chunk_s)
    assert relative_errors(m, sim.executor.step_log)["max"] < 1e-6


def test_sim_abort_and_errors() -> None:
    clock = VirtualClock()
    sim = make_sim("pensieve", clock)
    sim.add_request("r0", [1, 2, 3], SamplingParams(max_tokens=50), conversation_id="c")
    sim.step()
    sim.abort_request("r0")
    assert not sim.has_unfinished()
    assert sim.conversation_history("c") == []
    with pytest.raises(ValueError):
        sim.add_request("r1", [], SamplingParams())
    with pytest.raises(ValueError):
        sim.add_request("r1", [999], SamplingParams())
    with pytest.raises(ValueError):
        SimEngine(SchedulerConfig(), 8, 8, STEP, clock, COST, chunk_size=16)
    sim.add_request("r2", [1, 2, 3], SamplingParams(max_tokens=2))  # one-off request
    while sim.has_unfinished():
        (out,) = sim.step() or (None,)
    assert out is not None and out.output_token_ids == [0, 0]
    assert "r2" not in sim.cache.conversations


def test_sim_from_config() -> None:
    from pensieve.config import CacheConfig, EngineConfig

    cfg = EngineConfig(cache=CacheConfig(chunk_size=CHUNK, num_gpu_blocks=24, cpu_kv_gb=1e-5,
                                         cache_policy="lru"))
    sim = SimEngine.from_config(cfg, STEP, VirtualClock(), COST, block_bytes=1024)
    assert sim.cache.gpu.num_blocks == 24
    assert sim.cache.cpu is not None and sim.cache.cpu.num_blocks == int(1e-5 * 2**30 // 1024)
    assert sim.cache.policy.name == "lru"
    with pytest.raises(ValueError):
        SimEngine.from_config(EngineConfig(), STEP, VirtualClock(), COST)


def test_import_does_not_load_torch() -> None:
    code = ("import sys, pensieve.sim.simulator, pensieve.sim.step_cost; "
            "bad = [m for m in ('torch', 'numpy', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_load_past_max_model_len_fails_that_turn_only() -> None:
    """A turn whose context would pass max_model_len is refused by the engine (a server answers
    400): run_load records it as an error and ends its conversation; the run goes on, the
    other conversations finish and nothing stays in flight."""
    from pensieve.bench.loadgen import run_load
    from pensieve.bench.workload import Conversation, Turn

    clock = VirtualClock()
    sim = SimEngine(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8,
                                    max_model_len=512), 128, 64, STEP, clock, COST,
                    chunk_size=CHUNK, cache_policy="pensieve", block_bytes=1000, vocab_size=256)
    long = Conversation("long", [Turn(200, 40), Turn(200, 40), Turn(200, 40), Turn(10, 5)])
    short = Conversation("short", [Turn(20, 5), Turn(10, 5)])
    res = run_load(sim, clock, [long, short, short], conv_rate=1.0, think_time_s=0.5,
                   duration_s=3.0, vocab_size=256, seed=1, drain_s=1000.0)
    assert res.unfinished == 0
    turns: dict[str, list[tuple[int, bool]]] = {}
    for r in res.records:
        turns.setdefault(r.conversation, []).append((r.turn, r.error))
    assert turns, "no conversation arrived"
    longs = [sorted(v) for k, v in turns.items() if int(k[1:]) % 3 == 0]
    assert longs and all(v == [(0, False), (1, False), (2, True)] for v in longs)
    assert all(sorted(v) == [(0, False), (1, False)]
               for k, v in turns.items() if int(k[1:]) % 3)
    assert res.samples[-1]["sessions_in_flight"] == 0
    assert res.samples[-1]["requests_in_flight"] == 0


def test_warm_start_begins_with_the_steady_sessions_in_flight() -> None:
    """With a warm start, the sessions that arrived before time 0 and would still be under way
    are in flight from the first sample (as many as Little's law gives for the assumed latency),
    each sends only its remaining turns, its first request carries its whole history so far,
    and every session ends by the end of the run."""
    from pensieve.bench.loadgen import WarmStart, run_load
    from pensieve.bench.workload import Conversation, Turn

    conv = Conversation("c", [Turn(12, 10)] * 4)
    warm = WarmStart(s_per_output_token=0.1, ttft_s=0.0, horizon_s=60.0)
    # lifetime under the assumed latency: 4 turns of 1 s + 3 think times of mean 1 s = 7 s
    rate, expected = 5.0, 5.0 * 7.0
    clock = VirtualClock()
    sim = SimEngine(SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64,
                                    max_model_len=512), 1024, 256, STEP, clock, COST,
                    chunk_size=CHUNK, cache_policy="pensieve", block_bytes=1000, vocab_size=256)
    res = run_load(sim, clock, [conv], conv_rate=rate, think_time_s=1.0, duration_s=2.0,
                   vocab_size=256, seed=3, drain_s=1000.0, warm_start=warm)
    first = res.samples[0]
    assert first["t"] == 0
    assert abs(first["sessions_in_flight"] - expected) < 3 * expected ** 0.5
    assert first["sessions_started"] == first["sessions_in_flight"]
    assert res.unfinished == 0 and not any(r.error for r in res.records)
    by_conv: dict[str, list] = {}
    for r in res.records:
        by_conv.setdefault(r.conversation, []).append(r)
    warm_convs = [v for v in by_conv.values() if min(r.turn for r in v) > 0]
    assert warm_convs, "no session was thinking or answering a later turn at time 0"
    for recs in by_conv.values():
        recs.sort(key=lambda r: r.turn)
        turns = [r.turn for r in recs]
        assert turns == list(range(turns[0], 4))  # its remaining turns, each once
        k = turns[0]
        assert recs[0].input_len == k * 22 + 12  # the history so far, then the new input
        assert [r.context_len for r in recs] == [(j + 1) * 12 + j * 10 for j in turns]
    last = res.samples[-1]  # taken when one was due: sessions may still be thinking then
    assert last["sessions_in_flight"] == sum(v[-1].finished > last["t"] for v in by_conv.values())
    assert last["sessions_started"] == len(by_conv)


def test_cold_start_arrivals_are_unchanged_by_the_warm_start_option() -> None:
    """Without a warm start the run is what it always was: the first arrival sends turn 0."""
    from pensieve.bench.loadgen import WarmStart, run_load
    from pensieve.bench.workload import Conversation, Turn

    conv = Conversation("c", [Turn(12, 10)] * 2)

    def run(warm: WarmStart | None) -> list:
        clock = VirtualClock()
        sim = SimEngine(SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64,
                                        max_model_len=512), 1024, 256, STEP, clock, COST,
                        chunk_size=CHUNK, cache_policy="pensieve", block_bytes=1000,
                        vocab_size=256)
        return run_load(sim, clock, [conv], conv_rate=2.0, think_time_s=0.5, duration_s=3.0,
                        vocab_size=256, seed=4, drain_s=100.0, warm_start=warm).records

    cold = run(None)
    assert cold and cold[0].sent > 0 and all(r.input_len == 12 for r in cold)
    assert cold[0].conversation == "c0"
    warm = run(WarmStart(horizon_s=30.0))
    assert min(r.sent for r in warm) < cold[0].sent or len(warm) > len(cold)
    with pytest.raises(ValueError):
        WarmStart(horizon_s=0)


def test_sim_keeps_the_step_compute_the_copies_run_beside() -> None:
    """The engine keeps the cache's ``step_overlap_s`` at its decode-only steps' time on its
    clock (virtual time here): within the range of those steps' modelled costs."""
    clock = VirtualClock()
    sim = make_sim("pensieve", clock)
    assert sim.cache.step_overlap_s == 0
    drive(sim, clock)
    decode = [dt for f, dt in sim.executor.step_log
              if f.num_prefill_tokens == 0 and f.num_decode_tokens]
    assert decode, "no decode-only step"
    assert min(decode) <= sim.cache.step_overlap_s <= max(decode)
