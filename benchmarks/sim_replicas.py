"""Scale on paper: N replicas behind conversation-affinity routing against random routing, in
the simulator validated on the H200 churn points.

Each replica is one simulated H200 with the set-up of the real churn points (Llama 2-13B
GQA-10 shape, 40 GB GPU tier, 60 GB CPU tier, pensieve policy, the step cost fitted on the real
points, the measured copy rates and retention cost profile; ``sim_validate_churn.py``). N
replicas (:class:`pensieve.bench.replicas_sim.ReplicatedSim`) get N times the per-replica
session rate; a router of :mod:`pensieve.core.routing` picks each turn's replica: ``affinity``
(the conversation's key in rendezvous order, bounded load) or ``random``. A turn that lands
away from its conversation's KV is recomputed there from the history (as replicas that share a
conversation store do). Prints every point and, per (N, routing), the capacity at each P90
target (highest throughput under it, interpolated between rates) and its ratio to N = 1;
writes JSON and a PNG::

    python benchmarks/sim_replicas.py --out docs/results/sim_replicas          # CPU, ~15 min
    python benchmarks/sim_replicas.py --tiny --out /tmp/sim_replicas           # smoke test
    python benchmarks/sim_replicas.py --workload sharegpt --rates 0.9,1.3,1.8 --duration 400 \
        --warmup 200 --workers 1 --out docs/results/sim_replicas_sharegpt      # CPU, ~12 min
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_churn_jobs import (  # noqa: E402
    PROFILE,
    add_sweep_args,
    conversations,
    make_sim,
    sweep_times,
    transfer_model,
)

from pensieve.bench.metrics import capacity_at, summarize  # noqa: E402
from pensieve.bench.step_cost import StepCostModel  # noqa: E402


def point(job: dict[str, Any]) -> dict[str, Any]:
    """One (N, routing, rate) point."""
    from pensieve.bench.engine_api import VirtualClock
    from pensieve.bench.loadgen import run_load, warm_start_from
    from pensieve.bench.replicas_sim import ReplicatedSim, replica_names
    from pensieve.core.cost_model import CostModel
    from pensieve.core.routing import AffinityRouter, RandomRouter

    t0 = time.time()
    cost = StepCostModel.from_dict(job["cost"])
    chunk_cost = CostModel.load(PROFILE)  # loaded once, shared by the replicas
    transfer = transfer_model()

    def make(clock: VirtualClock) -> Any:
        return make_sim(job, cost, clock, chunk_cost, transfer)

    n = job["replicas"]
    names = replica_names(n)
    router = (AffinityRouter(names) if job["routing"] == "affinity"
              else RandomRouter(names, seed=job["seed"]))
    clock = VirtualClock()
    eng = ReplicatedSim(n, make, clock, router)
    convs = conversations(job["workload"], job["seed"], 8, job["length_scale"])
    res = run_load(eng, clock, convs, job["rate"], job["think"], job["duration"], 32000,
                   seed=job["seed"], drain_s=job["drain"], sample_interval_s=5.0,
                   warm_start=warm_start_from(job.get("warm_start")))
    p = {"replicas": n, "routing": job["routing"], "system": job["system"],
         "conv_rate": job["rate"], "rate_per_replica": job["rate"] / n,
         "unfinished": res.unfinished, **summarize(res, job["warmup"]),
         **eng.routing_stats(), "sim_wall_s": round(time.time() - t0, 1)}
    p.pop("steady", None)
    return p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/results/sim_replicas")
    ap.add_argument("--replicas", default="1,2,4,8")
    ap.add_argument("--routings", default="affinity,random")
    ap.add_argument("--system", default="pensieve")
    ap.add_argument("--rates", default="0.6,0.8,0.9,1.0",
                    help="new sessions/s per replica (N replicas get N times each)")
    ap.add_argument("--workload", default="agentic", choices=["agentic", "sharegpt"])
    ap.add_argument("--think", type=float, default=5.0)
    ap.add_argument("--gpu-kv-gb", type=float, default=40.0)
    ap.add_argument("--cpu-kv-gb", type=float, default=60.0)
    add_sweep_args(ap, targets="50,100")
    args = ap.parse_args(argv)
    cost = StepCostModel.load(args.step_cost)
    ns = [int(x) for x in args.replicas.split(",")]
    routings = args.routings.split(",")
    rates = [float(r) for r in args.rates.split(",")]
    duration, warmup, drain, scale = sweep_times(args)
    jobs = [{"replicas": n, "routing": routing, "system": args.system, "rate": r * n,
             "think": args.think, "gpu_kv_gb": args.gpu_kv_gb, "cpu_kv_gb": args.cpu_kv_gb,
             "duration": duration, "warmup": warmup, "drain": drain, "seed": args.seed,
             "workload": args.workload, "length_scale": scale, "cost": cost.to_dict(),
             "warm_start": args.warm_start, "recompute_rule": args.recompute_rule}
            for n in ns for routing in routings for r in rates
            if not (n == 1 and routing != routings[0])]  # one replica: routing is moot
    jobs.sort(key=lambda j: -j["replicas"])  # longest first
    t0 = time.time()
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    points: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=max(1, args.workers)) as ex:
        it = ex.map(point, jobs)
        bar = tqdm(it, total=len(jobs), desc="points", file=sys.stderr) if tqdm else it
        for p in bar:
            points.append(p)
    for p in points:
        if p.get("normalized_latency_s_p90") is None:
            p["normalized_latency_s_p90"] = math.inf
    print(f"{'N':>2} {'routing':>8} {'sess/s':>6} {'req/s':>7} {'P50 ms/t':>9} {'P90 ms/t':>9} "
          f"{'gpu/cpu/recomp':>16} {'moved':>6} {'max/mean':>8}")
    for p in sorted(points, key=lambda p: (p["replicas"], p["routing"], p["conv_rate"])):
        print(f"{p['replicas']:>2} {p['routing']:>8} {p['conv_rate']:>6.2f} "
              f"{p['throughput_rps']:>7.2f} {p['normalized_latency_s_p50'] * 1e3:>9.1f} "
              f"{p['normalized_latency_s_p90'] * 1e3:>9.1f} "
              f"{p['gpu_hit_rate']:.2f}/{p['cpu_hit_rate']:.2f}/{p['recomputed_rate']:.2f}"
              f"{p['moved_turns']:>7} {p['max_over_mean_load']:>8.2f}")
    caps: dict[str, dict[str, float | None]] = {}
    for t in (float(x) for x in args.targets.split(",")):
        c: dict[str, float | None] = {}
        for n in ns:
            for routing in routings:
                ps = [p for p in points if p["replicas"] == n
                      and (p["routing"] == routing or n == 1)]
                c[f"{n}/{routing}"] = capacity_at(ps, t / 1e3)
        caps[f"{t:.0f}ms"] = c
        base = c.get(f"1/{routings[0]}")
        for routing in routings:
            parts = []
            for n in ns:
                v = c[f"{n}/{routing}"]
                ratio = f" ({v / base:.2f}x)" if v is not None and base else ""
                parts.append(f"N={n} {v:.2f}{ratio}" if v is not None else f"N={n} -")
            print(f"capacity at P90 {t:.0f} ms/token, {routing}: " + ", ".join(parts))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim_replicas.json").write_text(json.dumps(
        {"args": vars(args), "points": points, "capacity": caps,
         "wall_s": round(time.time() - t0, 1)}, indent=1,
        default=lambda o: None if isinstance(o, float) else str(o)))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.5))
    for routing, ls in zip(routings, ("-", "--")):
        for n in ns:
            ps = sorted((p for p in points if p["replicas"] == n
                         and (p["routing"] == routing or n == 1)), key=lambda p: p["conv_rate"])
            if n == 1 and routing != routings[0]:
                continue
            ax.plot([p["throughput_rps"] / n for p in ps],
                    [min(p["normalized_latency_s_p90"] * 1e3, 1e4) for p in ps], "o" + ls,
                    label=f"N={n} {routing}")
    for t in (float(x) for x in args.targets.split(",")):
        ax.axhline(t, color="grey", ls=":", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("throughput per replica (req/s)")
    ax.set_ylabel("P90 normalized latency (ms/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    t_main = float(args.targets.split(",")[-1])
    for routing, mk in zip(routings, ("o-", "s--")):
        xs = [n for n in ns if caps[f"{t_main:.0f}ms"].get(f"{n}/{routing}") is not None]
        bx.plot(xs, [caps[f"{t_main:.0f}ms"][f"{n}/{routing}"] for n in xs], mk, label=routing)
    base = caps[f"{t_main:.0f}ms"].get(f"1/{routings[0]}")
    if base:
        bx.plot(ns, [base * n for n in ns], ":", color="grey", label="N x one replica")
    bx.set_xlabel("replicas")
    bx.set_ylabel(f"capacity at P90 {t_main:.0f} ms/token (req/s)")
    bx.grid(alpha=0.3)
    bx.legend(fontsize=8)
    fig.suptitle(f"{args.workload}, {args.system}, 13B GQA-10 per replica, "
                 f"{args.gpu_kv_gb:.0f}/{args.cpu_kv_gb:.0f} GB tiers (simulated)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "sim_replicas.png", dpi=110)
    print(f"wrote {out}/sim_replicas.json, .png; {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
