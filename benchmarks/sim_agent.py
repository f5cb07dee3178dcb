"""Retention order on long-context agent loads, simulated: pensieve vs prefix-lru vs stateless.

The simulator (:class:`~pensieve.sim.simulator.SimEngine`: the engine's scheduler and tiered
cache over virtual time) runs the coding-agent and mixed loads
(:mod:`pensieve.bench.coding_agent`) through the load generator of :mod:`pensieve.bench.multiturn`
(Poisson session arrivals, exponential think time ``--think``, 6 s) on the ``llama3.1-8b``
shape: 32 layers, 32 query / 8 KV heads of 128, hidden 4096, MLP 14336; K+V 128 KiB a token
in bf16; 40 GB GPU and 60 GB CPU tiers (GiB; 10,240 and 15,360 blocks of 32 tokens);
``max_model_len`` 131,072; 8,192 tokens a step, chunked prefill.

Step cost (no 8B measurement at these lengths exists yet; the assumption is stated in the JSON):
the step-cost fit of the engine-process servers on the H200 (Llama 2-13B GQA-10,
``docs/results/sim_churn_process/step_cost_churn_fit_all.json``) with each weight- and
KV-bound term scaled by the 8B / 13B ratio of the roofline (:meth:`StepCostModel.analytic`),
the per-request host cost kept, and attention at 2x the roofline per query-key pair
(``--attn-efficiency 0.5``: FlashAttention-class kernels at long context; the 13B fit's
5.2x came from the 4k-context kernel of that engine). Copies: 45 GB/s each way, swap-ins
pipelined by layer. The retention value's Cost(l): the analytic roofline of the same shape.

Systems: the cache policies by name (``stateless``, ``prefix-lru``, ``pensieve``, ``return``,
...) and ``oracle``, the clairvoyant order the load generator tells each conversation's next
arrival (:class:`~pensieve.core.eviction.OraclePolicy`; the server does not offer it): the
bound on what any eviction order can gain; ``oracle-belady``, the same blind to recompute cost
(the conversation needed last goes first). ``--kv-cache-dtype fp8_e4m3`` asks what FP8 KV would
do: one byte per value, so each tier holds twice the chunks, each copy moves half the bytes and
each step reads half the KV bytes (the step cost's KV-read and copy terms halved; attention
compute unchanged). ``--copy-gbps`` sets the copy rate each way (default: the transfer
model's 45 GB/s).

Per workload and system, a sweep of session rates; per point the window's throughput, TTFT
and normalized latency percentiles, and the prefill tokens computed and the part of them
that was history recomputed (dropped chunks, or CPU chunks sooner recomputed than copied).
Capacity: the highest throughput (requests/s and sessions/s) whose P90 TTFT meets each
``--ttft-targets`` (interpolated between rates, ``pensieve.bench.run_metrics.capacity_at``)::

    python benchmarks/sim_agent.py --out docs/results/sim_agent
    python benchmarks/sim_agent.py --tiny --out /tmp/sim_agent     # a smoke test

Writes ``<out>/sim_agent.json`` and ``<out>/sim_agent.png`` (P90 TTFT against throughput).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from pensieve.bench.run_metrics import capacity_at
from pensieve.sim.step_cost import StepCostModel

ROOT = Path(__file__).resolve().parents[1]
"""The source tree (the fit below is a recorded result of it, not package data)."""
FIT_13B = ROOT / "docs" / "results" / "sim_churn_process" / "step_cost_churn_fit_all.json"
SHAPE = {"num_layers": 32, "hidden_size": 4096, "num_heads": 32, "num_kv_heads": 8,
         "head_dim": 128, "intermediate_size": 14336}
"""llama3.1-8b (the lead's preset ``llama3.1-8b``)."""
PARAMS_8B, PARAMS_13B = 8.03e9, 13.0e9
CHUNK = 32
KV_BYTES_PER_TOKEN = 2 * SHAPE["num_layers"] * SHAPE["num_kv_heads"] * SHAPE["head_dim"] * 2
"""bf16 K+V of one token over all layers."""
KV_DTYPE_BYTES = {"bf16": 2, "fp8_e4m3": 1}
MAX_MODEL_LEN = 131072
IDEAL_GPU_BLOCKS = 1_000_000
"""The ideal's GPU tier (32M tokens): more than every conversation of a run holds, so no
chunk is ever evicted, swapped or recomputed (``sim_ideal.py`` checks none was)."""
RATES = {"coding-agent": "0.02,0.04,0.06,0.08,0.1",
         "agent-mix": "0.1,0.2,0.3,0.4,0.5"}


def step_cost(attn_efficiency: float, kv_dtype: str = "bf16") -> StepCostModel:
    """The 13B fit carried to the 8B shape (module docstring); with ``kv_dtype`` of one byte,
    the KV-read and copy terms halved."""
    fit = StepCostModel.load(FIT_13B)
    a13 = StepCostModel.analytic(PARAMS_13B, 40, 40, 10, 128)
    a8 = StepCostModel.analytic(PARAMS_8B, SHAPE["num_layers"], SHAPE["num_heads"],
                                SHAPE["num_kv_heads"], SHAPE["head_dim"])

    def scaled(name: str) -> float:
        return getattr(fit, name) * getattr(a8, name) / getattr(a13, name)

    kv = KV_DTYPE_BYTES[kv_dtype] / 2
    return dataclasses.replace(
        fit, base_s=scaled("base_s"), per_prefill_token_s=scaled("per_prefill_token_s"),
        per_kv_read_token_s=scaled("per_kv_read_token_s") * kv,
        per_attn_pair_s=a8.per_attn_pair_s / attn_efficiency,
        swap_copy_chunk_s=a8.swap_copy_chunk_s * kv, source="manual",
        label=f"13B process fit scaled to llama3.1-8b by the roofline ratios; attention at "
              f"{attn_efficiency:g} of the H200 bf16 peak; host per request as fitted; "
              f"KV in {kv_dtype}")


def conversations(workload: str, seed: int, scale: float) -> list[Any]:
    from pensieve.bench.commands import load_workload
    from pensieve.bench.workload import Conversation, Turn

    convs = list(load_workload(workload, 3000, seed).conversations)
    if scale != 1.0:
        convs = [Conversation(c.conv_id, [Turn(max(1, round(t.input_len * scale)),
                                               max(1, round(t.output_len * scale)))
                                          for t in c.turns]) for c in convs]
    random.Random(seed).shuffle(convs)  # as pensieve.bench.multiturn
    return convs


def engine(job: dict[str, Any]) -> tuple[Any, Any, dict[str, float | None] | None]:
    """The simulated engine of one point, its clock, and the map of think times the load
    generator fills for the ``oracle`` systems (None for the others)."""
    from pensieve.bench.engine_api import VirtualClock
    from pensieve.core.cost_model import CostModel
    from pensieve.core.eviction import EvictionPolicy, OraclePolicy
    from pensieve.core.scheduling_config import SchedulerConfig
    from pensieve.sim.simulator import DEFAULT_TRANSFER, SimEngine

    block_bytes = KV_BYTES_PER_TOKEN * KV_DTYPE_BYTES[job["kv_dtype"]] // 2 * CHUNK
    next_think_s: dict[str, float | None] | None = None
    policy: str | EvictionPolicy = job["system"]
    if policy in ("oracle", "oracle-belady"):  # told each next arrival by the load generator
        next_think_s = {}
        policy = OraclePolicy(name=policy, weigh_cost=policy == "oracle",
                              next_think_s=next_think_s)
    transfer = DEFAULT_TRANSFER
    if job["copy_gbps"]:
        transfer = dataclasses.replace(transfer, swap_in_gbps=job["copy_gbps"],
                                       swap_out_gbps=job["copy_gbps"])
    gpu_blocks = int(job["gpu_gb"] * 2**30 // block_bytes)
    cpu_blocks = int(job["cpu_gb"] * 2**30 // block_bytes)
    step_time = None
    if policy == "ideal":  # the bound (pensieve.sim.ideal): a GPU tier nothing leaves
        from pensieve.sim.ideal import ForwardRates, IdealStepTime

        step_time = IdealStepTime(ForwardRates(**job["ideal_rates"]))
        gpu_blocks, cpu_blocks, policy, transfer = IDEAL_GPU_BLOCKS, 0, "gpu-only", None
    clock = VirtualClock()
    eng = SimEngine(SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256,
                                    max_model_len=MAX_MODEL_LEN),
                    gpu_blocks, cpu_blocks,
                    StepCostModel.from_dict(job["cost"]), clock,
                    CostModel.analytic(**SHAPE, chunk_size=CHUNK), chunk_size=CHUNK,
                    cache_policy=policy, block_bytes=block_bytes, transfer=transfer,
                    share_prefixes=False,  # as the studies in the docs ran
                    step_time=step_time)
    return eng, clock, next_think_s


def sim_point(job: dict[str, Any]) -> dict[str, Any]:
    """One simulated point: the window's summary plus the run's recomputation totals."""
    from pensieve.bench.loadgen import WarmStart, run_load
    from pensieve.bench.run_metrics import summarize, window

    t0 = time.time()
    eng, clock, next_think_s = engine(job)
    convs = conversations(job["workload"], job["seed"], job["scale"])
    warm = WarmStart(s_per_output_token=job["warm_start"]) if job.get("warm_start") else None
    res = run_load(eng, clock, convs, job["rate"], job["think"], job["duration"], 32000,
                   seed=job["seed"], drain_s=job["drain"], sample_interval_s=1.0,
                   next_think_s=next_think_s, warm_start=warm)
    p = {"workload": job["workload"], "system": job["system"], "conv_rate": job["rate"],
         "kv_dtype": job["kv_dtype"],
         "unfinished": res.unfinished, **summarize(res, job["warmup"])}
    st = p.pop("steady", None) or {}
    p["steady_unsteady"] = st.get("unsteady")
    inside = [x for x in res.samples if job["warmup"] <= x["t"] < job["duration"]]
    for k in ("sessions_in_flight", "gpu_blocks_used", "cpu_blocks_used", "requests_waiting"):
        xs = [x[k] for x in inside if k in x]
        p[f"window_mean_{k}"] = round(sum(xs) / len(xs), 1) if xs else None
    done = [r for r in window(res, job["warmup"]) if r.finished is not None]
    p["recomputed_tokens"] = sum(r.cache.get("recomputed_tokens", 0) for r in done)
    # of which CPU chunks chosen for recomputation (sooner than their copy), not dropped ones
    p["cpu_recomputed_tokens"] = sum(r.cache.get("cpu_recomputed_tokens", 0) for r in done)
    p["new_prompt_tokens"] = sum(r.cache.get("new_prompt_tokens", 0) for r in done)
    p["swap_in_chunks"] = eng.executor.swap_in_chunks
    p["swap_out_chunks"] = eng.executor.swap_out_chunks
    p["steps"] = step_totals(eng.executor, res)
    p["sim_wall_s"] = round(time.time() - t0, 1)
    return p


def step_totals(executor: Any, res: Any) -> dict[str, float]:
    """The whole run's steps summed (warm-up and drain included): simulated busy seconds,
    of which copy waits, and each step feature (``StepFeatures``), with the turns finished,
    so that a report can split a turn's GPU time by what it went to."""
    out: dict[str, float] = {"num_steps": len(executor.step_log),
                             "busy_s": executor.busy_time_s,
                             "exposed_copy_s": executor.exposed_copy_s,
                             "turns_finished": sum(1 for r in res.records
                                                   if r.finished is not None)}
    for f, _dt in executor.step_log:
        for k in ("num_prefill_tokens", "num_decode_tokens", "num_requests", "attn_pairs",
                  "kv_read_tokens"):
            out[k] = out.get(k, 0.0) + getattr(f, k)
        out["prefill_steps"] = out.get("prefill_steps", 0) + (f.num_prefill_tokens > 0)
    return out


def capacities(points: list[dict[str, Any]], targets: list[float]) -> dict[str, Any]:
    """Per workload, target and system: capacity in requests/s and sessions/s."""
    out: dict[str, Any] = {}
    for wl in sorted({p["workload"] for p in points}):
        for t in targets:
            row: dict[str, Any] = {}
            for s in sorted({p["system"] for p in points if p["workload"] == wl}):
                ps = [p for p in points if p["workload"] == wl and p["system"] == s]
                ps = [{**p, "ttft_s_p90": p["ttft_s_p90"] if math.isfinite(p["ttft_s_p90"])
                       else math.inf} for p in ps]
                sess = [{**p, "throughput_rps": p["conv_rate"]} for p in ps]
                row[s] = {"req_per_s": round(capacity_at(ps, t, "ttft_s_p90"), 4),
                          "sessions_per_s": round(capacity_at(sess, t, "ttft_s_p90"), 4)}
            out[f"{wl}@{t:g}s"] = row
    return out


def plot(points: list[dict[str, Any]], targets: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wls = sorted({p["workload"] for p in points})
    fig, axes = plt.subplots(1, len(wls), figsize=(6 * len(wls), 4.3), squeeze=False)
    for ax, wl in zip(axes[0], wls):
        for s in sorted({p["system"] for p in points if p["workload"] == wl}):
            ps = sorted((p for p in points if p["workload"] == wl and p["system"] == s),
                        key=lambda p: p["conv_rate"])
            ax.plot([p["conv_rate"] for p in ps], [min(p["ttft_s_p90"], 1e3) for p in ps],
                    "o-", label=s)
        for t in targets:
            ax.axhline(t, color="grey", ls=":", lw=0.8)
        ax.set_yscale("log")
        ax.set_xlabel("sessions/s offered")
        ax.set_ylabel("P90 TTFT (s)")
        kv = ps[0].get("kv_dtype", "bf16") if ps else "bf16"
        ax.set_title(f"{wl}: llama3.1-8b shape, 40/60 GB tiers, {kv} KV (simulated)",
                     fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/results/sim_agent")
    ap.add_argument("--workloads", default="coding-agent,agent-mix")
    ap.add_argument("--systems", default="stateless,prefix-lru,pensieve",
                    help="cache policies by name, and oracle, oracle-belady (module docstring)")
    ap.add_argument("--rates", default=None,
                    help="WORKLOAD=R1,R2;... (default: " + "; ".join(
                        f"{k}={v}" for k, v in RATES.items()) + ")")
    ap.add_argument("--think", type=float, default=6.0, help="mean think time (s)")
    ap.add_argument("--gpu-gb", type=float, default=40.0)
    ap.add_argument("--cpu-gb", type=float, default=60.0)
    ap.add_argument("--duration", type=float, default=900.0, help="seconds of arrivals")
    ap.add_argument("--warmup", type=float, default=400.0)
    ap.add_argument("--drain", type=float, default=120.0)
    ap.add_argument("--attn-efficiency", type=float, default=0.5)
    ap.add_argument("--copy-gbps", type=float, default=None,
                    help="copy rate between the tiers, each way (GB/s; default: the transfer "
                         "model's)")
    ap.add_argument("--kv-cache-dtype", choices=sorted(KV_DTYPE_BYTES), default="bf16",
                    help="KV bytes per value: fp8_e4m3 doubles the chunks each tier holds")
    ap.add_argument("--ttft-targets", default="2,5", help="P90 TTFT targets (s)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="smoke test: short runs, short turns")
    args = ap.parse_args(argv)
    rates = dict(RATES)
    for part in (args.rates or "").split(";"):
        if part:
            k, v = part.split("=")
            rates[k] = v
    duration, warmup, drain, scale = ((60.0, 20.0, 20.0, 0.05) if args.tiny else
                                      (args.duration, args.warmup, args.drain, 1.0))
    cost = step_cost(args.attn_efficiency, args.kv_cache_dtype)
    jobs = [{"workload": wl, "system": s, "rate": float(r), "think": args.think,
             "gpu_gb": args.gpu_gb, "cpu_gb": args.cpu_gb, "duration": duration,
             "warmup": warmup, "drain": drain, "seed": args.seed, "scale": scale,
             "cost": cost.to_dict(), "kv_dtype": args.kv_cache_dtype,
             "copy_gbps": args.copy_gbps}
            for wl in args.workloads.split(",") for s in args.systems.split(",")
            for r in rates[wl].split(",")]
    t0 = time.time()
    with ProcessPoolExecutor(max_workers=max(1, args.workers)) as ex:
        points = list(ex.map(sim_point, jobs))
    targets = [float(x) for x in args.ttft_targets.split(",")]
    print(f"{'workload':>12} {'system':>10} {'rate':>5} {'req/s':>6} {'TTFT P50':>8} "
          f"{'P90':>7} {'ms/tok P90':>10} {'gpu/cpu/recomp':>15} {'prefill Mtok':>12} "
          f"{'recomp Mtok':>11} {'unfin':>5}")
    for p in points:
        print(f"{p['workload']:>12} {p['system']:>10} {p['conv_rate']:>5} "
              f"{p['throughput_rps']:>6.2f} {p['ttft_s_p50']:>8.2f} {p['ttft_s_p90']:>7.2f} "
              f"{p['normalized_latency_s_p90'] * 1e3:>10.1f} "
              f"{p['gpu_hit_rate']:.2f}/{p['cpu_hit_rate']:.2f}/{p['recomputed_rate']:.2f} "
              f"{(p['prefill_computed_tokens'] or 0) / 1e6:>12.2f} "
              f"{p['recomputed_tokens'] / 1e6:>11.2f} {p['unfinished']:>5}")
    caps = capacities(points, targets)
    for k, row in caps.items():
        print(f"capacity {k}: " + ", ".join(
            f"{s} {v['sessions_per_s']:.3f} sess/s ({v['req_per_s']:.2f} req/s)"
            for s, v in row.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"args": vars(args), "step_cost": cost.to_dict(), "points": points,
           "capacity_at_p90_ttft": caps, "wall_s": round(time.time() - t0, 1)}
    (out / "sim_agent.json").write_text(json.dumps(
        doc, indent=1, default=lambda o: None if isinstance(o, float) else str(o)) + "\n")
    plot(points, targets, out / "sim_agent.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
