"""Routing across replicas with a shared KV tier, simulated: affinity only, affinity with
spill, and least-loaded, at 2, 4 and 8 replicas, with and without a replica lost mid-run.

Each replica is the calibrated simulator of its load (:class:`~pensieve.sim.simulator.
SimEngine`: the engine's scheduler and tiered cache over a fitted step cost):

* ``agentic``: the set-up of the real H200 churn points (``sim_churn_jobs.make_sim``: Llama
  2-13B GQA-10 shape, 40 / 60 GB tiers, the engine-process fit, the measured copies), think
  5 s; 200 KiB of KV a token.
* ``coding-agent``: ``sim_agent.py``'s set-up (llama3.1-8b shape, the 13B fit scaled by the
  roofline, 40 / 60 GB tiers, ``max_model_len`` 131,072), think 6 s; 128 KiB a token.

The replicas (``shared_tier_sim.RoutedCluster``; its docstring has the model) get N times the
per-replica session rate. Routings: ``affinity`` (today's default; a turn away from its KV
recomputes its history), ``spill@BOUND`` (the owner unless its waiting prompt tokens pass
BOUND, then the least-loaded; the KV read from the shared tier) and ``least`` (least waiting
tokens, the KV from the shared tier), each shared-tier routing at every ``--gbps`` (one link
per replica, each way). With ``--fail both`` (or ``yes``), every point is run (only) with
replica 0 lost at ``--fail-at`` s too.

Per point: the window's throughput and TTFT percentiles, the turns moved, the context tokens
read from the tier against those recomputed, and the busiest replica's link use. Per (load,
N, routing): the capacity, sessions/s at each P90 TTFT target (interpolated between rates,
``run_metrics.capacity_at``); with a replica lost, the window's P90 over the whole window,
the TTFT spike (the highest P90 of ``--bin`` s bins of sends after the loss) and its length
(from the loss to the end of the last bin over the first target)::

    python benchmarks/replicas_routing.py --out docs/results/replicas_routing
    python benchmarks/replicas_routing.py --tiny --out /tmp/rr          # a smoke test
    python benchmarks/replicas_routing.py --merge A/replicas_routing.json B/... --out DIR

Writes ``<out>/replicas_routing.json`` and ``<out>/replicas_routing.png``.
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

from pensieve.bench.run_metrics import capacity_at, percentile  # noqa: E402

LOADS = {
    "agentic": {"rates": "0.8,1.0,1.2", "think": 5.0, "kv_bytes": 2 * 40 * 10 * 128 * 2},
    "coding-agent": {"rates": "0.05,0.07,0.09", "think": 6.0, "kv_bytes": 2 * 32 * 8 * 128 * 2},
}


def _replica_maker(job: dict[str, Any]) -> Any:
    """``make(clock)`` of one replica of the job's load."""
    from pensieve.core.cost_model import CostModel
    from pensieve.sim.step_cost import StepCostModel

    if job["load"] == "agentic":
        from sim_churn_jobs import FIT_ALL, PROFILE, make_sim, transfer_model

        root = Path(__file__).resolve().parents[1]
        cost = StepCostModel.load(root / FIT_ALL)
        chunk_cost = CostModel.load(PROFILE)
        transfer = transfer_model()
        sim_job = {"gpu_kv_gb": 40.0, "cpu_kv_gb": 60.0, "system": "pensieve"}
        return lambda clock: make_sim(sim_job, cost, clock, chunk_cost, transfer)
    from sim_agent import CHUNK, KV_BYTES_PER_TOKEN, MAX_MODEL_LEN, SHAPE, step_cost

    from pensieve.core.scheduling_config import SchedulerConfig
    from pensieve.sim.simulator import DEFAULT_TRANSFER, SimEngine

    cost = step_cost(0.5)
    chunk_cost = CostModel.analytic(**SHAPE, chunk_size=CHUNK)
    block = KV_BYTES_PER_TOKEN * CHUNK
    return lambda clock: SimEngine(
        SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256,
                        max_model_len=MAX_MODEL_LEN),
        int(40 * 2**30 // block), int(60 * 2**30 // block), cost, clock, chunk_cost,
        chunk_size=CHUNK, cache_policy="pensieve", block_bytes=block,
        transfer=DEFAULT_TRANSFER)


def _conversations(job: dict[str, Any]) -> list[Any]:
    if job["load"] == "agentic":
        from sim_churn_jobs import conversations

        return conversations("agentic", job["seed"], 0, job["scale"])
    from sim_agent import conversations as agent_conversations

    return agent_conversations("coding-agent", job["seed"], job["scale"])


def point(job: dict[str, Any]) -> dict[str, Any]:
    """One (load, N, routing, rate, fail) point."""
    from shared_tier_sim import RoutedCluster

    from pensieve.bench.engine_api import VirtualClock
    from pensieve.bench.loadgen import run_load, warm_start_from
    from pensieve.bench.run_metrics import summarize

    t0 = time.time()
    clock = VirtualClock()
    routing, _, bound = job["routing"].partition("@")
    eng = RoutedCluster(job["replicas"], _replica_maker(job), clock, routing,
                        LOADS[job["load"]]["kv_bytes"], gbps=job["gbps"],
                        bound=float(bound or 0), fail_at=job["fail_at"])
    res = run_load(eng, clock, _conversations(job), job["rate"], job["think"],
                   job["duration"], 32000, seed=job["seed"], drain_s=job["drain"],
                   sample_interval_s=5.0, warm_start=warm_start_from(job["warm_start"]))
    p: dict[str, Any] = {k: job[k] for k in ("load", "replicas", "routing", "gbps", "fail_at")}
    p.update(conv_rate=job["rate"], rate_per_replica=round(job["rate"] / job["replicas"], 4),
             unfinished=res.unfinished)
    s = summarize(res, job["warmup"])
    for k in ("requests", "finished", "throughput_rps", "ttft_s_p50", "ttft_s_p90",
              "ttft_s_p99", "gpu_hit_rate", "cpu_hit_rate", "recomputed_rate"):
        v = s.get(k)
        p[k] = round(v, 4) if isinstance(v, float) and math.isfinite(v) else v
    p.update(eng.routing_stats())
    p["network"] = eng.network(job["warmup"], job["duration"])
    p["ttft_p90_bins"] = _bins(res, job["bin"], job["duration"])
    p["sim_wall_s"] = round(time.time() - t0, 1)
    return p


def _bins(res: Any, bin_s: float, duration: float) -> list[float | None]:
    """P90 TTFT of the turns sent in each ``bin_s`` bin (unfinished: infinite)."""
    nb = int(duration // bin_s)
    xs: list[list[float]] = [[] for _ in range(nb)]
    for r in res.records:
        b = int(r.sent // bin_s)
        if 0 <= b < nb:
            xs[b].append(r.ttft if r.ttft is not None else math.inf)
    return [None if not x else round(min(percentile(x, 90), 1e6), 3) for x in xs]


def loss_effect(p: dict[str, Any], target: float, bin_s: float) -> dict[str, Any]:
    """TTFT spike after the loss (highest bin P90) and its length: from the loss to the end
    of the last bin whose P90 passes ``target`` (0: none does)."""
    first = int(p["fail_at"] // bin_s)
    after = [(i, v) for i, v in enumerate(p["ttft_p90_bins"]) if i >= first and v is not None]
    spike = max((v for _, v in after), default=None)
    over = [i for i, v in after if v > target]
    length = (over[-1] + 1) * bin_s - p["fail_at"] if over else 0.0
    return {"spike_p90_s": spike, "over_target_s": round(length, 1),
            "until_end": bool(over) and over[-1] == len(p["ttft_p90_bins"]) - 1}


def summary(points: list[dict[str, Any]], targets: list[float], bin_s: float
            ) -> list[dict[str, Any]]:
    """One row per (load, N, routing, gbps, fail): capacity at each target, and loss effects
    at each rate (with a loss)."""
    rows = []
    keys = sorted({(p["load"], p["replicas"], p["routing"], p["gbps"] or 0, p["fail_at"] or 0)
                   for p in points})
    for load, n, routing, gbps, fail in keys:
        ps = [p for p in points if (p["load"], p["replicas"], p["routing"], p["gbps"] or 0,
                                    p["fail_at"] or 0) == (load, n, routing, gbps, fail)]
        ps = [{**p, "ttft_s_p90": p["ttft_s_p90"] if p["ttft_s_p90"] is not None
               and math.isfinite(p["ttft_s_p90"]) else math.inf} for p in ps]
        row: dict[str, Any] = {"load": load, "replicas": n, "routing": routing,
                               "gbps": gbps or None, "fail_at": fail or None}
        for t in targets:
            sess = [{**p, "throughput_rps": p["conv_rate"]} for p in ps]
            row[f"sessions_per_s@{t:g}s"] = round(capacity_at(sess, t, "ttft_s_p90"), 4)
        if fail:
            row["loss"] = {str(p["conv_rate"]): loss_effect(p, targets[0], bin_s)
                           for p in sorted(ps, key=lambda p: p["conv_rate"])}
        rows.append(row)
    return rows


def jobs_of(args: argparse.Namespace) -> list[dict[str, Any]]:
    routings = ["affinity"] + [f"spill@{b}" for b in args.bounds.split(",") if b] + (
        ["least"] if args.least else [])
    gbps = [float(g) for g in args.gbps.split(",")]
    fails = {"no": [None], "yes": [args.fail_at], "both": [None, args.fail_at]}[args.fail]
    tiny = args.tiny
    jobs = []
    for load in args.loads.split(","):
        rates = (args.rates or {}).get(load) or LOADS[load]["rates"]
        for n in (int(x) for x in args.replicas.split(",")):
            for routing in routings:
                for g in ([None] if routing == "affinity" else gbps):
                    for r in (float(x) for x in rates.split(",")):
                        for f in fails:
                            jobs.append({
                                "load": load, "replicas": n, "routing": routing, "gbps": g,
                                "rate": r * n, "think": LOADS[load]["think"],
                                "duration": 60.0 if tiny else args.duration,
                                "warmup": 20.0 if tiny else args.warmup,
                                "drain": 10.0 if tiny else args.drain,
                                "fail_at": (40.0 if tiny else f) if f else None,
                                "seed": args.seed, "scale": 0.05 if tiny else 1.0,
                                "warm_start": None if tiny else args.warm_start or None,
                                "bin": args.bin})
    jobs.sort(key=lambda j: -j["replicas"] * (5 if j["load"] == "coding-agent" else 1))
    return jobs


def markdown(rows: list[dict[str, Any]], points: list[dict[str, Any]], targets: list[float]
             ) -> str:
    """The docs' table: per (load, N, routing, Gb/s), capacity at each target with all
    replicas up ("≥": the highest rate run meets the target); at the highest rate run, the
    turns moved, the tier's reads and the busiest link's read use (mean / peak 10 s); with a
    replica lost (the rate of that run), the window's P90 TTFT, the spike and how long the
    bins stayed over the first target."""
    head = ("| load | N | routing | Gb/s | " + " | ".join(
        f"sessions/s at P90 TTFT {t:g} s" for t in targets)
        + " | moved turns, reads (GB), read link use mean / peak | one lost @ sessions/s: "
          "window P90, spike, over target |")
    lines = [head, "| --- | ---: | --- | ---: | " + "---: | " * len(targets) + "--- | --- |"]
    up = [r for r in rows if not r["fail_at"]]
    for r in up:
        same = [p for p in points if (p["load"], p["replicas"], p["routing"], p["gbps"] or 0)
                == (r["load"], r["replicas"], r["routing"], r["gbps"] or 0)]
        top = max((p for p in same if not p["fail_at"]), key=lambda p: p["conv_rate"])
        net = top["network"]
        use = (f", {net['read_gb']:.0f} GB, {net['read_util_mean_max']:.2f} / "
               f"{net['read_util_peak']:.2f}" if net else "")
        lost = [p for p in same if p["fail_at"]]
        loss = "; ".join(
            f"@{p['conv_rate']:.3g}: {_s(p['ttft_s_p90'])}, {_s(e['spike_p90_s'])}, "
            f"{e['over_target_s']:.0f} s{'+' if e['until_end'] else ''}"
            for p in lost for e in [loss_effect(p, targets[0], p.get("bin", 10.0))])
        lines.append(
            f"| {r['load']} | {r['replicas']} | {r['routing']} | {r['gbps'] or '-'} | "
            + " | ".join(("≥ " if _passes(top, t) else "")
                         + f"{r[f'sessions_per_s@{t:g}s']:.3f}" for t in targets)
            + f" | {top['moved_turns']} @{top['conv_rate']:.3g}{use} | {loss or '-'} |")
    return "\n".join(lines)


def _passes(p: dict[str, Any], target: float) -> bool:
    """Whether a point's P90 TTFT meets ``target`` (the highest rate run: capacity is more)."""
    return p["ttft_s_p90"] is not None and p["ttft_s_p90"] <= target


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s" if v < 1e5 else "unbounded"


def plot(rows: list[dict[str, Any]], points: list[dict[str, Any]], targets: list[float],
         path: Path) -> None:
    """Per load, capacity at the first target against N (all replicas up); then the P90 TTFT
    of the turns sent in each bin around a replica's loss, per routing and N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted({r["load"] for r in rows})
    lost = [p for p in points if p["fail_at"]]
    fig, axes = plt.subplots(1, len(loads) + bool(lost), figsize=(5.2 * (len(loads) + 1), 4),
                             squeeze=False)
    t = targets[0]
    names = sorted({(r["routing"], r["gbps"] or 0) for r in rows})
    color = {k: f"C{i}" for i, k in enumerate(names)}
    for ax, load in zip(axes[0], loads):
        for routing, gbps in names:
            rs = sorted((r for r in rows if r["load"] == load and r["routing"] == routing
                         and (r["gbps"] or 0) == gbps and not r["fail_at"]),
                        key=lambda r: r["replicas"])
            if rs:
                ax.plot([r["replicas"] for r in rs], [r[f"sessions_per_s@{t:g}s"] for r in rs],
                        "o-", color=color[routing, gbps],
                        label=routing + (f" {gbps:g} Gb/s" if gbps else ""))
        ax.set_xlabel("replicas")
        ax.set_ylabel(f"sessions/s at P90 TTFT <= {t:g} s")
        ax.set_title(f"{load}, all replicas up (simulated)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    if lost:
        ax = axes[0][-1]
        styles = {n: ls for n, ls in zip(sorted({p["replicas"] for p in lost}),
                                          ("-", "--", ":", "-."))}
        for p in sorted(lost, key=lambda p: (p["routing"], p["replicas"])):
            bins = p["ttft_p90_bins"]
            xs = [10.0 * (i + 0.5) for i, v in enumerate(bins) if v is not None]
            ax.plot(xs, [min(v, 1e3) for v in bins if v is not None],
                    styles[p["replicas"]], color=color[p["routing"], p["gbps"] or 0], lw=1,
                    label=f"{p['routing']} N={p['replicas']}")
            ax.axvline(p["fail_at"], color="grey", lw=0.8)
        ax.axhline(t, color="grey", ls=":", lw=0.8)
        ax.set_yscale("log")
        ax.set_xlabel("time of send (s); the line: replica 0 lost")
        ax.set_ylabel("P90 TTFT of the 10 s bin (s)")
        ax.set_title(f"{lost[0]['load']}, one replica lost (simulated)", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=5, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=60)
    plt.close(fig)
    from PIL import Image  # a palette image: a third of the bytes (docs/results is capped)

    Image.open(path).convert("RGB").quantize(256).save(path, optimize=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/results/replicas_routing")
    ap.add_argument("--loads", default="agentic,coding-agent")
    ap.add_argument("--replicas", default="2,4,8")
    ap.add_argument("--rates", type=lambda s: dict(x.split("=") for x in s.split(";") if x),
                    default=None, help="LOAD=R1,R2;... sessions/s per replica (default: "
                    + "; ".join(f"{k}={v['rates']}" for k, v in LOADS.items()) + ")")
    ap.add_argument("--bounds", default="16384",
                    help="spill bounds, waiting prompt tokens on the owner (comma list)")
    ap.add_argument("--no-least", dest="least", action="store_false",
                    help="leave the least-loaded routing out")
    ap.add_argument("--gbps", default="25,100", help="network rates, Gb/s per link each way")
    ap.add_argument("--fail", choices=["no", "yes", "both"], default="both",
                    help="run each point with all replicas up, with one lost, or both")
    ap.add_argument("--fail-at", type=float, default=200.0, help="when replica 0 is lost (s)")
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of arrivals")
    ap.add_argument("--warmup", type=float, default=150.0)
    ap.add_argument("--drain", type=float, default=60.0)
    ap.add_argument("--warm-start", type=float, default=0.03, metavar="S_PER_TOKEN",
                    help="start at a steady state: the sessions that would be under way at "
                         "time 0 are (loadgen.WarmStart; 0 turns it off)")
    ap.add_argument("--bin", type=float, default=10.0, help="TTFT bins after a loss (s)")
    ap.add_argument("--ttft-targets", default="2,5", help="P90 TTFT targets (s)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="smoke test: short runs, short turns")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="run nothing: the points of these outputs, summarized together")
    args = ap.parse_args(argv)
    targets = [float(x) for x in args.ttft_targets.split(",")]
    from tqdm import tqdm

    t0 = time.time()
    if args.merge:
        points = [p for f in args.merge for p in json.loads(Path(f).read_text())["points"]]
    else:
        points = []
        with ProcessPoolExecutor(max_workers=max(1, args.workers)) as ex:
            for p in tqdm(ex.map(point, jobs_of(args)), total=len(jobs_of(args)),
                          desc="points", file=sys.stderr):
                points.append(p)
                tqdm.write(f"{p['load']} N={p['replicas']} {p['routing']} {p['gbps']} "
                           f"fail={p['fail_at']} {p['conv_rate']:.3g}: TTFT P90 "
                           f"{p['ttft_s_p90']} s, {p['throughput_rps']:.2f} req/s",
                           file=sys.stderr)
    print(f"{'load':>12} {'N':>2} {'routing':>11} {'Gb/s':>4} {'fail':>4} {'sess/s':>6} "
          f"{'req/s':>6} {'TTFT P50':>8} {'P90':>7} {'moved':>6} {'read Mtok':>9} "
          f"{'recomp Mtok':>11} {'rx use':>6}")
    for p in points:
        net = p["network"]
        print(f"{p['load']:>12} {p['replicas']:>2} {p['routing']:>11} {p['gbps'] or 0:>4g} "
              f"{'yes' if p['fail_at'] else 'no':>4} {p['conv_rate']:>6.3g} "
              f"{p['throughput_rps']:>6.2f} {p['ttft_s_p50'] or math.inf:>8.2f} "
              f"{p['ttft_s_p90'] or math.inf:>7.2f} {p['moved_turns']:>6} "
              f"{p['loaded_tokens'] / 1e6:>9.2f} {p['recomputed_history_tokens'] / 1e6:>11.2f} "
              f"{net.get('read_util_mean_max', 0):>6.2f}")
    rows = summary(points, targets, args.bin)
    for r in rows:
        print(f"capacity {r['load']} N={r['replicas']} {r['routing']} {r['gbps'] or ''} "
              f"{'one lost' if r['fail_at'] else ''}: " + ", ".join(
                  f"{r[f'sessions_per_s@{t:g}s']:.3f} sess/s at {t:g} s" for t in targets)
              + (f"; loss {r['loss']}" if r.get("loss") else ""))
    print(markdown(rows, points, targets))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for p in points:  # the bins matter around a loss only (docs/results is capped)
        if not p["fail_at"]:
            p.pop("ttft_p90_bins", None)
    doc = {"args": vars(args), "capacity": rows, "points": points,
           "wall_s": round(time.time() - t0, 1)}
    (out / "replicas_routing.json").write_text(json.dumps(
        doc, default=lambda o: None if isinstance(o, float) else str(o),
        separators=(",", ":")) + "\n")
    plot(rows, points, targets, out / "replicas_routing.png")
    print(f"wrote {out}/replicas_routing.json, .png; {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
