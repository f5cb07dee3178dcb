"""benchmarks/sim_validate_churn.py at tiny size: reads the real churn points, runs the
simulator on a short, scaled-down version of their load, recalibrates, writes its outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
VALIDATE = [sys.executable, str(BENCHMARKS / "sim_validate_churn.py")]


@pytest.mark.slow  # fits and simulates every real churn point, even at tiny size
def test_sim_validate_churn_tiny(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    r = subprocess.run([*VALIDATE, "--tiny", "--workers", "1",
                        "--whatif-systems", "stateless,pensieve", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads((tmp_path / "sim_validate_churn.json").read_text())
    assert len(d["real"]) == 6  # three pairs of the current engine
    assert {p["system"] for p in d["real"]} == {"stateless", "pensieve", "prefix-lru"}
    assert all(p["prefill_steps"] > 0 and p["decode_step_s"] > 0 for p in d["real"])
    assert set(d["models"]) == {"fit_one", "fit_all"}
    assert len(d["held_out"]) == 2 and d["fit_pair"] not in d["held_out"]
    for name in ("fused fit as is", "held out (fit on one pair)", "all-pairs fit (in-sample)"):
        assert len(d["sim"][name]) == 6
    assert d["copies"]["source"].endswith("[hybrid, random]")
    assert len(d["whatif"]) == 2
    assert (tmp_path / "sim_validate_churn.png").stat().st_size > 0
    assert (tmp_path / "step_cost_churn_fit_all.json").exists()


def test_sim_churn_capacity_tiny(tmp_path: Path) -> None:
    """``benchmarks/sim_churn_capacity.py`` at tiny size: every (system, rate) point is run and a
    capacity is reported per target for each system."""
    pytest.importorskip("matplotlib")
    r = subprocess.run([sys.executable, str(BENCHMARKS / "sim_churn_capacity.py"), "--tiny",
                        "--workers", "1", "--rates", "0.5,1.0", "--systems",
                        "stateless,pensieve", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads((tmp_path / "sim_churn_capacity.json").read_text())
    assert {(p["system"], p["conv_rate"]) for p in d["points"]} == {
        (s, x) for s in ("stateless", "pensieve") for x in (0.5, 1.0)}
    assert set(d["capacity"]) == {"50ms", "100ms", "150ms"}
    assert all(set(c) == {"stateless", "pensieve"} for c in d["capacity"].values())
    assert (tmp_path / "sim_churn_capacity.png").stat().st_size > 0
    # each point's state over time (50 s bins of the 1 s samples), and its plot
    for p in d["points"]:
        ts = [r["t"] for r in p["ramp"]]
        assert ts == [50.0 * i for i in range(len(ts))] and len(ts) >= 1
        assert all(r["sessions_in_flight"] >= 0 and r["gpu_blocks_used"] >= 0
                   for r in p["ramp"])
    assert any(r["sessions_in_flight"] > 0 for p in d["points"] for r in p["ramp"])
    assert (tmp_path / "sim_churn_ramp.png").stat().st_size > 0


def test_ramp_bins_the_samples() -> None:
    ramp = _jobs().ramp
    samples = [{"t": t, "sessions_in_flight": t, "gpu_blocks_used": 2 * t} for t in range(0, 7)]
    got = ramp(samples, every_s=3.0)
    assert [r["t"] for r in got] == [0.0, 3.0, 6.0]
    assert [r["sessions_in_flight"] for r in got] == [1.0, 4.0, 6.0]
    assert [r["gpu_blocks_used"] for r in got] == [2.0, 8.0, 12.0]
    assert got[0]["requests_waiting"] == 0.0  # a count the samples lack reads 0


def _bench() -> Any:
    """``benchmarks/sim_validate.py``: the real points and the fit behind the tool."""
    import sim_validate as svc

    return svc


def _jobs() -> Any:
    import sim_churn_jobs as jobs

    return jobs


def test_sides_and_scheduler_settings() -> None:
    """The ahead off/on pair has pensieve on both sides: they stay apart (by side), A runs
    with swap-ins ahead off, B with the default; the pairs measured before swap-ins ahead
    existed run with it off on both sides. The per-step means are the servers' totals."""
    svc = _bench()
    real = svc.load_real(("prefixlru_pensieve_1.2", "pensieve_ahead_off_on_0.9"))
    assert [(p["pair"], p["side"]) for p in real] == [
        ("prefixlru_pensieve_1.2", "A"), ("prefixlru_pensieve_1.2", "B"),
        ("pensieve_ahead_off_on_0.9", "A"), ("pensieve_ahead_off_on_0.9", "B")]
    a, b = real[2], real[3]
    assert a["system"] == b["system"] == "pensieve"
    assert a["scheduler"] == {"swap_in_ahead_chunks": 0} and b["scheduler"] == {}
    assert all(p["scheduler"] == {"swap_in_ahead_chunks": 0} for p in real[:2])
    for pair in svc.DEFAULT_PAIRS:
        assert svc.SCHEDULER[pair] == {"A": svc.AHEAD_OFF, "B": svc.AHEAD_OFF}
    # step_totals.txt of the pair: prefill steps 53.0 / 47.7 ms, net 60.7 / 53.2 us per token
    assert round(a["prefill_step_mean_s"] * 1e3, 1) == 53.0
    assert round(b["prefill_step_mean_s"] * 1e3, 1) == 47.7
    assert round(a["prefill_token_net_s"] * 1e6, 1) == 60.7
    assert round(b["prefill_token_net_s"] * 1e6, 1) == 53.2
    assert [svc.point_name(p, real) for p in real] == [
        "prefix-lru@1.2", "pensieve@1.2", "pensieve@0.9 (A)", "pensieve@0.9 (B)"]
    assert svc.same_point({"pair": a["pair"], "side": "A"}, a)
    assert not svc.same_point({"pair": a["pair"], "side": "B"}, a)
    # a recorded setting wins over the table
    assert svc.scheduler_overrides("pensieve_ahead_off_on_0.9", "B",
                                   {"swap_in_ahead_chunks": 64}) == {"swap_in_ahead_chunks": 64}
    assert svc.scheduler_overrides("some_new_pair", "A", {}) == {}


def test_make_sim_takes_the_scheduler_settings() -> None:
    from pensieve.bench.engine_api import VirtualClock
    from pensieve.sim.step_cost import StepCostModel

    svc, jobs = _bench(), _jobs()
    cost = StepCostModel.load(jobs.FIT_ALL)
    job = {"gpu_kv_gb": 1.0, "cpu_kv_gb": 1.0, "system": "pensieve"}
    assert jobs.make_sim(job, cost, VirtualClock()).scheduler.config.swap_in_ahead_chunks == 256
    off = jobs.make_sim(job | {"scheduler": svc.AHEAD_OFF}, cost, VirtualClock())
    assert off.scheduler.config.swap_in_ahead_chunks == 0


def test_sim_validate_fitted_tiny(tmp_path: Path) -> None:
    """``--fitted``: the ahead off/on pair simulated with the all-pairs fit as is (tiny size),
    each side with its own scheduler settings, errors per side."""
    pytest.importorskip("matplotlib")
    r = subprocess.run([*VALIDATE, "--tiny", "--workers", "1", "--fitted",
                        str(ROOT / "docs/results/sim_churn/step_cost_churn_fit_all.json"),
                        "--pairs", "pensieve_ahead_off_on_0.9", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads((tmp_path / "sim_validate_churn.json").read_text())
    assert [p["side"] for p in d["real"]] == ["A", "B"]
    (name,) = d["sim"]
    sims = d["sim"][name]
    assert [(p["side"], p["scheduler"]) for p in sims] == [
        ("A", {"swap_in_ahead_chunks": 0}), ("B", {})]
    assert all(p["prefill_steps"] > 0 and p["prefill_step_mean_s"] > 0 for p in sims)
    assert set(d["errors"][name]) == {"pensieve@0.9 (A)", "pensieve@0.9 (B)"}
    assert all(e["throughput_rps"] is not None for e in d["errors"][name].values())
    assert "side A; scheduler swap_in_ahead_chunks=0" in (tmp_path / "table.txt").read_text()
    assert (tmp_path / "sim_validate_churn.png").stat().st_size > 0


def test_real_jobs_simulate_each_points_workload() -> None:
    """A ShareGPT pair is simulated on the ShareGPT lengths, an agentic pair on the agentic
    sessions, each with its own tiers and think time."""
    import argparse

    from pensieve.sim.step_cost import StepCostModel

    svc = _bench()
    pairs = ("sharegpt_stateless_pensieve_0.7", "agentic_words_prefixlru_pensieve_0.85")
    real = svc.load_real(pairs)
    args = argparse.Namespace(tiny=False, seed=0, template_tokens=8)
    jobs = svc.real_jobs(real, StepCostModel.load(_jobs().FIT_ALL), "m", args, pairs)
    got = {(j["pair"], j["side"]): (j["workload"], j["gpu_kv_gb"], j["think"]) for j in jobs}
    assert got == {
        ("sharegpt_stateless_pensieve_0.7", "A"): ("sharegpt", 8.0, 6.0),
        ("sharegpt_stateless_pensieve_0.7", "B"): ("sharegpt", 8.0, 6.0),
        ("agentic_words_prefixlru_pensieve_0.85", "A"): ("agentic", 40.0, 5.0),
        ("agentic_words_prefixlru_pensieve_0.85", "B"): ("agentic", 40.0, 5.0),
    }
    convs = _jobs().conversations("sharegpt", 0, 0, 1.0)
    assert len(convs) > 1000 and convs[0].turns[0].output_len > 0


def test_one_server_runs_load_as_side_a() -> None:
    """A run of one system alone (``churn_points.sh pensieve 0.85``) has side A only: it loads
    as one point with its server's totals."""
    real = _bench().load_real(("agentic_words_process_pensieve_0.85",))
    assert [(p["side"], p["system"]) for p in real] == [("A", "pensieve")]
    assert real[0]["prefill_steps"] > 0 and real[0]["prefill_token_net_s"] > 0


def test_what_if_copy_rates() -> None:
    """``--swap-gbps``: one rate for both ways or IN,OUT; a simulated engine then charges its
    copies at those rates (the default: the measured ones)."""
    import sim_churn_capacity as sim_churn_capacity

    assert sim_churn_capacity.swap_gbps(None) is None
    assert sim_churn_capacity.swap_gbps("30") == [30.0, 30.0]
    assert sim_churn_capacity.swap_gbps("40,50") == [40.0, 50.0]
    for bad in ("0", "1,2,3", "-5,5"):
        with pytest.raises(SystemExit):
            sim_churn_capacity.swap_gbps(bad)
    jobs = _jobs()
    what_if = jobs.transfer_model([30.0, 20.0])
    assert (what_if.swap_in_gbps, what_if.swap_out_gbps, what_if.num_layers) == (30.0, 20.0, 40)
    measured = jobs.transfer_model()
    assert measured.swap_in_gbps > 40 and "swap_bandwidth.json" in measured.source

    from pensieve.bench.engine_api import VirtualClock
    from pensieve.sim.step_cost import StepCostModel

    job = {"gpu_kv_gb": 1.0, "cpu_kv_gb": 1.0, "system": "pensieve", "swap_gbps": [30.0, 20.0]}
    eng = jobs.make_sim(job, StepCostModel.load(jobs.FIT_ALL), VirtualClock())
    assert (eng.executor.transfer.swap_in_gbps, eng.executor.transfer.swap_out_gbps) == (30.0, 20.0)


