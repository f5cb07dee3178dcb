"""benchmarks/sim_agent.py: the long-context agent sweep in the simulator, tiny."""

from __future__ import annotations

import json
from pathlib import Path

import sim_agent


def test_step_cost_is_the_13b_fit_carried_to_the_8b_shape() -> None:
    from pensieve.sim.step_cost import StepCostModel

    fit = StepCostModel.load(sim_agent.FIT_13B)
    c = sim_agent.step_cost(0.5)
    assert 0.5 * fit.base_s < c.base_s < fit.base_s  # fewer weights to read
    assert c.per_request_s == fit.per_request_s  # host cost kept
    half = sim_agent.step_cost(1.0)
    assert c.per_attn_pair_s == 2 * half.per_attn_pair_s
    assert sim_agent.KV_BYTES_PER_TOKEN == 128 * 1024


def test_tiny_sweep_writes_points_capacity_and_plot(tmp_path: Path) -> None:
    sim_agent.main(["--tiny", "--workers", "1", "--out", str(tmp_path),
                    "--systems", "stateless,pensieve", "--workloads", "coding-agent",
                    "--rates", "coding-agent=0.1,0.2", "--ttft-targets", "1,5"])
    doc = json.loads((tmp_path / "sim_agent.json").read_text())
    pts = {(p["system"], p["conv_rate"]): p for p in doc["points"]}
    assert set(pts) == {("stateless", 0.1), ("stateless", 0.2), ("pensieve", 0.1),
                        ("pensieve", 0.2)}
    for p in pts.values():
        assert p["finished"] > 0 and p["window_mean_sessions_in_flight"] is not None
        assert p["recomputed_tokens"] >= p["cpu_recomputed_tokens"] >= 0
    # stateless recomputes every history; pensieve keeps it
    assert pts[("stateless", 0.2)]["recomputed_tokens"] > 0
    assert pts[("pensieve", 0.2)]["recomputed_tokens"] < \
        pts[("stateless", 0.2)]["recomputed_tokens"]
    assert set(doc["capacity_at_p90_ttft"]) == {"coding-agent@1s", "coding-agent@5s"}
    assert (tmp_path / "sim_agent.png").stat().st_size > 1000


def test_fp8_kv_and_copy_rate_reach_the_engine_and_the_oracle_runs(tmp_path: Path) -> None:
    bf16, fp8 = sim_agent.step_cost(0.5), sim_agent.step_cost(0.5, "fp8_e4m3")
    assert fp8.per_kv_read_token_s == bf16.per_kv_read_token_s / 2
    assert fp8.swap_copy_chunk_s == bf16.swap_copy_chunk_s / 2
    assert fp8.per_attn_pair_s == bf16.per_attn_pair_s and fp8.base_s == bf16.base_s
    job = {"system": "oracle", "kv_dtype": "fp8_e4m3", "copy_gbps": 90.0, "gpu_gb": 40.0,
           "cpu_gb": 60.0, "cost": fp8.to_dict()}
    eng, _, think = sim_agent.engine(job)
    bf16_eng, _, none = sim_agent.engine({**job, "kv_dtype": "bf16", "copy_gbps": None,
                                          "system": "prefix-lru"})
    assert eng.cache.gpu.num_blocks == 2 * bf16_eng.cache.gpu.num_blocks == 2 * 10240
    # half the bytes per chunk at twice the rate: a quarter of the copy time the cache weighs
    assert eng.swap_chunk_s is not None and bf16_eng.swap_chunk_s is not None
    assert abs(eng.swap_chunk_s - bf16_eng.swap_chunk_s / 4) < 1e-12
    assert think == {} and none is None and eng.cache.policy.name == "oracle"
    sim_agent.main(["--tiny", "--workers", "1", "--out", str(tmp_path), "--systems", "oracle",
                    "--workloads", "agent-mix", "--rates", "agent-mix=0.3",
                    "--kv-cache-dtype", "fp8_e4m3"])
    (p,) = json.loads((tmp_path / "sim_agent.json").read_text())["points"]
    assert p["system"] == "oracle" and p["kv_dtype"] == "fp8_e4m3" and p["finished"] > 0
