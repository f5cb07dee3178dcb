"""The time series of multi-turn points: is the measurement window at steady state?

    python benchmarks/plot_timeseries.py results/churn/timeseries.jsonl [more.jsonl ...] \
        --out results/churn/churn [--title TITLE]

Reads the ``timeseries.jsonl`` lines that ``pensieve.bench.multiturn`` writes (one per point:
its samples, one a second) and draws ``<out>_timeseries.png``, one line per point (system @
rate): sessions in flight (client side; requests in flight dashed), GPU and CPU KV blocks used
as a share of the tier, requests running (waiting dashed), against time since the first
arrival. The measurement window is shaded, the drain hatched: in a steady window the curves
are flat apart from noise.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"pensieve": "tab:red", "gpu-only": "tab:orange", "lru": "tab:purple",
          "prefix-lru": "tab:green", "stateless": "tab:blue", "hf": "tab:gray"}


def load(paths: list[str]) -> list[dict[str, Any]]:
    out = []
    for p in paths:
        out += [json.loads(line) for line in Path(p).read_text().splitlines() if line.strip()]
    return out


def _share(samples: list[dict[str, Any]], tier: str) -> tuple[list[float], list[float]]:
    ts, ys = [], []
    for s in samples:
        used, total = s.get(f"{tier}_blocks_used"), s.get(f"{tier}_blocks_total")
        if used is not None and total:
            ts.append(s["t"])
            ys.append(used / total)
        elif tier == "gpu" and s.get("gpu_cache_usage") is not None:  # vLLM's gauge
            ts.append(s["t"])
            ys.append(s["gpu_cache_usage"])
    return ts, ys


def plot(series: list[dict[str, Any]], out: str, title: str) -> str:
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), sharex=True)
    (ax_s, ax_r), (ax_g, ax_c) = axes
    for i, d in enumerate(series):
        sm = d["samples"]
        if not sm:
            continue
        label = f"{d['system']} @ {d['conv_rate']:g}/s" + (f" [{d['tag']}]" if d.get("tag") else "")
        color = COLORS.get(d["system"]) if len({x["system"] for x in series}) == len(series) \
            else f"C{i}"
        t = [s["t"] for s in sm]
        ax_s.plot(t, [s.get("sessions_in_flight") for s in sm], color=color, label=label)
        ax_s.plot(t, [s.get("requests_in_flight") for s in sm], color=color, ls="--", lw=0.8)
        run = [(s["t"], s["requests_running"]) for s in sm
               if s.get("requests_running") is not None]
        wait = [(s["t"], s["requests_waiting"]) for s in sm
                if s.get("requests_waiting") is not None]
        if run:
            ax_r.plot(*zip(*run), color=color, label=label)
        if wait:
            ax_r.plot(*zip(*wait), color=color, ls="--", lw=0.8)
        for ax, tier in ((ax_g, "gpu"), (ax_c, "cpu")):
            ts, ys = _share(sm, tier)
            if ts:
                ax.plot(ts, ys, color=color, label=label)
    d0 = series[0]
    lo, hi = d0.get("warmup_s", 0.0), d0.get("duration_s", 0.0)
    drain = d0.get("drain_s") or 0.0
    for ax in axes.flat:
        ax.axvspan(lo, hi, color="k", alpha=0.07, lw=0)
        if drain:
            ax.axvspan(hi, hi + drain, facecolor="none", hatch="//", edgecolor="0.8", lw=0)
        ax.grid(alpha=0.3)
    ax_s.set_ylabel("sessions in flight (requests in flight dashed)")
    ax_r.set_ylabel("requests running (waiting dashed)")
    ax_g.set_ylabel("GPU KV blocks used (share of the tier)")
    ax_c.set_ylabel("CPU KV blocks used (share of the tier)")
    for ax in (ax_g, ax_c):
        ax.set_xlabel("time since the first arrival (s); window shaded, drain hatched")
        ax.set_ylim(-0.02, 1.05)
    ax_s.legend(fontsize=8)
    fig.suptitle(title or "multi-turn load: state over time")
    fig.tight_layout()
    path = f"{out}_timeseries.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("timeseries", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    series = load(args.timeseries)
    if not series:
        print("no time series")
        return 1
    print(plot(series, args.out, args.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
