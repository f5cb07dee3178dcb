"""Capacity of each policy on the agentic churn workload, in the simulator re-validated on the
H200 churn points (``benchmarks/sim_validate_churn.py``).

The real runs measured a few rates per system; this sweeps the rate in the simulator with
the step cost fitted on the real points (``--step-cost``; default the engine-process
servers' fit, ``docs/results/sim_churn_process/step_cost_churn_fit_all.json``), the measured
copy rates (or ``--swap-gbps``) and the retention cost profile the
servers used, the same set-up as the real points (Llama 2-13B GQA-10 shape, 40 GB GPU tier,
60 GB CPU tier, agentic sessions, think 5 s), and longer runs so the window is at steady
state for the rates a system can carry. It prints each point, the capacity (the highest
throughput with P90 normalized latency under each target, interpolated between rates) and
writes JSON (with each run's state over time, `ramp`) and two PNGs (capacity; `sim_churn_ramp.png`:
sessions in flight and GPU blocks used over each run, the window shaded)::

    python benchmarks/sim_churn_capacity.py --out docs/results/sim_churn_capacity_process

``--workload sharegpt`` sweeps the packaged ShareGPT lengths instead, with the tiers and think
time given (the real ShareGPT point of docs/benchmarks.md was 8 / 22 GB, think 6 s; the
paper's set-up is 40 / 220 GB, think 60 s)::

    python benchmarks/sim_churn_capacity.py --workload sharegpt --gpu-kv-gb 8 --cpu-kv-gb 22 \
        --think 6 --rates 0.4,0.5,0.6,0.7,0.8,1.0 --out docs/results/sim_sharegpt_capacity_process
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from sim_churn_jobs import add_sweep_args, run_jobs, sweep_times

from pensieve.bench.run_metrics import capacity_at
from pensieve.options import add_engine_args, engine_options
from pensieve.sim.step_cost import StepCostModel

SIM_ENGINE_OPTIONS = ("gpu_kv_gb", "cpu_kv_gb", "decode_reserve", "defer_admission")
"""The engine options the simulated jobs read (``benchmarks/sim_churn_jobs.py``)."""


def swap_gbps(text: str | None) -> list[float] | None:
    """``--swap-gbps IN,OUT`` (one number: both ways) as ``[in, out]``; None when absent."""
    if text is None:
        return None
    parts = [float(x) for x in text.split(",")]
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or not all(math.isfinite(x) and x > 0 for x in parts):
        raise SystemExit(f"--swap-gbps {text!r}: want IN,OUT, two positive rates in GB/s")
    return parts


def _moved(p: dict) -> str:
    """The steady-state check's verdict: '-' when sessions, tiers, running and waiting all
    stayed within 10% between the window's halves, else what moved, with its halves."""
    moved = p.get("steady_unsteady")
    if moved is None:
        return "?"
    halves = p.get("steady_halves") or {}
    return ", ".join(f"{k} {halves[k][0]:.0f}->{halves[k][1]:.0f}" if k in halves else k
                     for k in moved) or "-"


def build_parser() -> argparse.ArgumentParser:
    """The command line's options."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/results/sim_churn_capacity")
    ap.add_argument("--systems", default="stateless,prefix-lru,pensieve")
    ap.add_argument("--rates", default="0.4,0.5,0.6,0.7,0.8,1.0,1.2,1.4")
    ap.add_argument("--workload", choices=["agentic", "sharegpt"], default="agentic")
    ap.add_argument("--think", type=float, default=5.0, help="mean think time (s)")
    ap.add_argument("--template-tokens", type=int, default=8,
                    help="chat-template tokens a turn adds (the word-level chat model's)")
    # the engine options the simulated engine takes, from the config (pensieve.options)
    add_engine_args(ap, only=SIM_ENGINE_OPTIONS, defaults={"gpu_kv_gb": 40.0, "cpu_kv_gb": 60.0})
    ap.add_argument("--swap-gbps", default=None, metavar="IN,OUT",
                    help="what-if copy rates, GB/s each way (default: the measured hybrid "
                         "rates of docs/results/swap/swap_bandwidth.json)")
    add_sweep_args(ap, targets="50,100,150")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cost = StepCostModel.load(args.step_cost)
    systems = args.systems.split(",")
    rates = [float(r) for r in args.rates.split(",")]
    duration, warmup, drain, scale = sweep_times(args)
    opts = engine_options(args)
    jobs = [{"system": s, "rate": r, "pair": "capacity", "think": args.think,
             "gpu_kv_gb": opts["gpu_kv_gb"], "cpu_kv_gb": opts["cpu_kv_gb"],
             "duration": duration,
             "warmup": warmup, "drain": drain, "seed": args.seed, "workload": args.workload,
             "warm_start": args.warm_start, "recompute_rule": args.recompute_rule,
             "template_tokens": args.template_tokens,
             "decode_reserve": opts.get("decode_reserve"),
             "swap_gbps": swap_gbps(args.swap_gbps),
             "defer_admission": opts.get("defer_admission"),
             "length_scale": scale, "cost": cost.to_dict(), "model_name": args.step_cost}
            for s in systems for r in rates]
    t0 = time.time()
    points = run_jobs(jobs, args.workers)
    for p in points:
        if p.get("normalized_latency_s_p90") is None:
            p["normalized_latency_s_p90"] = math.inf
    print(f"{'system':>10} {'rate':>5} {'req/s':>7} {'P50 ms/t':>9} {'P90 ms/t':>9} "
          f"{'gpu/cpu/recomp':>16} {'unfinished':>10}  steady: moved > 10% (halves)")
    for p in sorted(points, key=lambda p: (systems.index(p["system"]), p["conv_rate"])):
        print(f"{p['system']:>10} {p['conv_rate']:>5} {p['throughput_rps']:>7.2f} "
              f"{p['normalized_latency_s_p50'] * 1e3:>9.1f} "
              f"{p['normalized_latency_s_p90'] * 1e3:>9.1f} "
              f"{p['gpu_hit_rate']:.2f}/{p['cpu_hit_rate']:.2f}/{p['recomputed_rate']:.2f}"
              f"{p['unfinished']:>10}  {_moved(p)}")
    caps: dict[str, dict[str, float | None]] = {}
    for t in (float(x) for x in args.targets.split(",")):
        c = {s: capacity_at([p for p in points if p["system"] == s], t / 1e3) for s in systems}
        caps[f"{t:.0f}ms"] = c
        base = c.get("stateless")
        line = ", ".join(f"{s} {v:.2f}" if v is not None else f"{s} -" for s, v in c.items())
        ratio = (f"; pensieve/stateless {c['pensieve'] / base:.2f}x"
                 if base and c.get("pensieve") else "")
        print(f"capacity at P90 {t:.0f} ms/token (req/s): {line}{ratio}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slim = [{k: v for k, v in p.items() if k not in ("kinds", "timeseries")} for p in points]
    (out / "sim_churn_capacity.json").write_text(json.dumps(
        {"args": vars(args), "points": slim, "capacity": caps,
         "wall_s": round(time.time() - t0, 1)}, indent=1,
        default=lambda o: None if isinstance(o, float) else str(o)))
    plot_capacity(points, systems, args, opts, out / "sim_churn_capacity.png")
    plot_ramp(points, systems, (warmup, duration), out / "sim_churn_ramp.png")
    print(f"wrote {out}/sim_churn_capacity.json, .png, sim_churn_ramp.png; "
          f"{time.time() - t0:.0f} s")
    return 0


def plot_capacity(points: list[dict], systems: list[str], args: argparse.Namespace,
                  opts: dict[str, Any], path: Path) -> None:
    """Throughput against P90 normalized latency per system, the targets dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for s in systems:
        ps = sorted((p for p in points if p["system"] == s), key=lambda p: p["conv_rate"])
        ax.plot([p["throughput_rps"] for p in ps],
                [min(p["normalized_latency_s_p90"] * 1e3, 1e4) for p in ps], "o-", label=s)
    for t in (float(x) for x in args.targets.split(",")):
        ax.axhline(t, color="grey", ls=":", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("throughput (req/s)")
    ax.set_ylabel("P90 normalized latency (ms/token)")
    tiers = f"{opts['gpu_kv_gb']:g}/{opts['cpu_kv_gb']:g} GB tiers"
    ax.set_title(f"{args.workload}, 13B GQA-10, {tiers}, "
                 f"think {args.think:g} s (simulated, validated fit)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_ramp(points: list[dict], systems: list[str], window: tuple[float, float],
              path: Path) -> None:
    """Sessions in flight and GPU blocks used over each run (the points' ``ramp``), one panel
    per system, one line per rate, the window shaded: is the window at steady state?"""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(systems), figsize=(4.5 * len(systems), 6), squeeze=False,
                             sharex=True)
    for j, s in enumerate(systems):
        for p in sorted((p for p in points if p["system"] == s), key=lambda p: p["conv_rate"]):
            ts = [r["t"] for r in p["ramp"]]
            for i, key in enumerate(("sessions_in_flight", "gpu_blocks_used")):
                axes[i][j].plot(ts, [r[key] for r in p["ramp"]], label=f"{p['conv_rate']:g}/s")
        axes[0][j].set_title(s)
        axes[1][j].set_xlabel("time since the first arrival (s)")
        for i in range(2):
            axes[i][j].axvspan(*window, color="grey", alpha=0.12)
            axes[i][j].grid(alpha=0.3)
    axes[0][0].set_ylabel("sessions in flight")
    axes[1][0].set_ylabel("GPU KV blocks used")
    axes[0][-1].legend(fontsize=7, title="sessions/s", title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
