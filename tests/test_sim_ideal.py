"""The ideal bound (pensieve.sim.ideal): its step time from measured rates, the fit behind
them, and, run in the simulator on a small load, that it computes only each turn's new tokens
and carries at least what every cache policy carries."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from pensieve.sim.ideal import (
    ForwardRates,
    IdealStepTime,
    attention_ratios,
    fit_forward,
    prefill_stall_steps,
)

RATES = ForwardRates(weights_bytes=16e9, kv_bytes_per_token=131072.0, hbm_bytes_per_s=4e12,
                     per_prefill_token_s=20e-6, per_attn_pair_s=1.5e-9,
                     attn_contexts=(32768, 131072), attn_best=(0.8, 1.0))


def _sched(*ranges: tuple[int, int]) -> SimpleNamespace:
    """A schedule of one request per ``(start_pos, query_len)``."""
    reqs = [SimpleNamespace(ranges=[SimpleNamespace(start_pos=s, query_len=q)])
            for s, q in ranges]
    return SimpleNamespace(requests=reqs)


def test_decode_step_is_the_hbm_floor() -> None:
    t = IdealStepTime(RATES)
    # 8 decodes after 10,000 tokens each: weights + 8 x 10,001 tokens of KV over HBM
    want = (16e9 + 8 * 10001 * 131072.0) / 4e12
    assert t(_sched(*[(10000, 1)] * 8)) == pytest.approx(want)


def test_prefill_step_at_the_faster_kernel() -> None:
    t = IdealStepTime(RATES)
    q, start = 2048, 30720  # ends at 32,768: SDPA's 0.8 of ours
    pairs = q * (start + (q + 1) / 2)
    want = 16e9 / 4e12 + 20e-6 * q + 1.5e-9 * 0.8 * pairs
    assert t(_sched((start, q))) == pytest.approx(want)
    # halfway between the measured contexts, the factor halfway between theirs
    assert RATES.best(81920) == pytest.approx(0.9)
    assert RATES.best(1000) == 0.8 and RATES.best(10**6) == 1.0
    # decodes riding along a long prefill hide under it
    assert t(_sched((start, q), (100, 1))) == pytest.approx(want)


def test_fit_forward_recovers_the_rates() -> None:
    a, b, w = 22e-6, 1.4e-9, 0.004
    steps = [{"tokens": q, "pairs": p, "time_s": w + a * q + b * p}
             for q, p in ((8192, 3e7), (8192, 1.2e8), (4096, 2e8), (8000, 4e8))]
    fa, fb = fit_forward(steps, w)
    assert fa == pytest.approx(a) and fb == pytest.approx(b)
    with pytest.raises(ValueError):
        fit_forward(steps[:1], w)


def test_measured_inputs_parse() -> None:
    """The recorded results the benchmark reads give rates of the expected size."""
    import json

    root = Path(__file__).resolve().parents[1] / "docs" / "results" / "long_context"
    steps = prefill_stall_steps(json.loads((root / "prefill_stall_auto_8192.json").read_text()))
    assert len(steps) == 8 and steps[0]["tokens"] == 8160 + 32
    a, b = fit_forward(steps, 8.03e9 * 2 / 4.3e12)
    assert 10e-6 < a < 40e-6 and 0.5e-9 < b < 3e-9
    ctx, best = attention_ratios(json.loads((root / "fp8_prefill_scratch.json").read_text())
                                 ["rows"])
    assert ctx == (32768, 65536, 131072) and all(0.5 < x <= 1.0 for x in best)


@pytest.fixture(scope="module")
def small_points() -> dict[str, dict]:
    """The ideal and three cache policies on a short coding-agent load (tiny turns) at one
    rate, with small tiers so that the policies evict, drop and swap."""
    import sim_agent
    import sim_ideal

    m = sim_ideal.measured()
    cost = sim_ideal.system_cost(m, "bf16").to_dict()
    ideal = dataclasses.asdict(sim_ideal.ideal_rates(m, "bf16"))
    out = {}
    for system in ("ideal", "pensieve", "prefix-lru", "stateless"):
        job = {"workload": "coding-agent", "system": system, "rate": 0.6, "think": 2.0,
               "gpu_gb": 0.05, "cpu_gb": 0.05, "duration": 40.0, "warmup": 10.0,
               "drain": 30.0, "seed": 0, "scale": 0.05, "cost": cost, "kv_dtype": "bf16",
               "copy_gbps": None, "warm_start": 0.05, "ideal_rates": ideal}
        out[system] = sim_agent.sim_point(job)
    return out


def test_ideal_computes_only_new_tokens(small_points: dict[str, dict]) -> None:
    p = small_points["ideal"]
    assert p["recomputed_tokens"] == 0 and p["swap_in_chunks"] == 0
    assert p["swap_out_chunks"] == 0 and p["steps"]["exposed_copy_s"] == 0.0
    assert p["prefill_computed_tokens"] == p["new_prompt_tokens"] > 0
    # the policies on the same load recompute some history (the tiers are small)
    assert small_points["stateless"]["recomputed_tokens"] > 0
    pen = small_points["pensieve"]
    assert pen["prefill_computed_tokens"] > pen["new_prompt_tokens"]


def test_ideal_carries_at_least_every_policy(small_points: dict[str, dict]) -> None:
    from sim_agent import capacities

    ideal = small_points["ideal"]
    for s in ("pensieve", "prefix-lru", "stateless"):
        assert ideal["ttft_s_p90"] <= small_points[s]["ttft_s_p90"]
        assert ideal["steps"]["busy_s"] / ideal["steps"]["turns_finished"] <= (
            small_points[s]["steps"]["busy_s"] / small_points[s]["steps"]["turns_finished"])
    caps = capacities(list(small_points.values()), [small_points["pensieve"]["ttft_s_p90"]])
    row = next(iter(caps.values()))
    assert all(row["ideal"]["sessions_per_s"] >= row[s]["sessions_per_s"] for s in row)


def test_ratios_take_each_kv_dtype_against_its_own_ideal() -> None:
    from sim_ideal_report import markdown, ratios

    caps = {"coding-agent@2s": {s: {"sessions_per_s": v} for s, v in (
        ("prefix-lru", 0.05), ("pensieve", 0.06), ("pensieve-fp8", 0.12), ("ideal", 0.2),
        ("ideal-fp8", 0.24))}}
    r = ratios(caps)["coding-agent@2s"]
    assert r["pensieve"] == pytest.approx(0.3) and r["pensieve-fp8"] == pytest.approx(0.5)
    assert r["pensieve/best"] == pytest.approx(0.25) and r["prefix-lru"] == pytest.approx(0.25)
    # a system whose highest simulated rate met the target is marked as a lower bound
    zero = dict.fromkeys(("busy", "prefill", "recompute", "other", "host", "copy_wait"), 0.0)
    pts = [{"workload": "coding-agent", "system": s, "conv_rate": rate, "ttft_s_p90": p90,
            "breakdown": zero}
           for s, rate, p90 in (("pensieve", 0.06, 3.0), ("ideal", 0.2, 1.5))]
    md = markdown({"capacity_at_p90_ttft": caps, "points": pts})
    assert "| coding-agent@2s | 0.050 | 0.060 | 0.120 | >= 0.200 | 0.240 | 0.25 | 0.30 | 0.50 |" \
        in md
