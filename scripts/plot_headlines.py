"""The headline figures at the top of docs/benchmarks.md, drawn from recorded results only.

- ``throughput_latency.png``: every real point of the current engine's servers under churn
  (``docs/results/churn/*/points.jsonl``, the engine-process runs on the agentic and the
  ShareGPT loads): requests finished per second against P90 normalized latency, by system.
- ``swap_rates.png``: the swapper's copy rates on the H200 by method and chunk count, one way
  and in + out together (``docs/results/swap/swap_bandwidth.json``).
- ``sim_vs_real.png``: the simulator against the real points it was validated on, throughput
  and P90 normalized latency (the ``table.txt`` of the validation runs named in
  :data:`SIM_TABLES`).

    python scripts/plot_headlines.py [--results docs/results] [--out docs/results/headline]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LOADS = {"agentic (40 / 60 GB tiers)": "agentic_words_process_*",
         "ShareGPT (40 / 60 GB tiers)": "sharegpt_40_60_process_*"}
"""Panel title -> the churn points it shows (engine-process servers, word-level tokenizer)."""
OVERLOAD = "agentic_words_overload_*_1.3"
"""The agentic overload points (one server per call), shown on the agentic panel."""
SIM_TABLES = ("sim_churn_process", "sim_sharegpt_40_60_heldout", "sim_validate_c545a71")
"""Validation runs whose tables hold real and simulated figures per point."""
COLORS = {"pensieve": "tab:blue", "stateless": "tab:orange", "prefix-lru": "tab:green"}


def churn_points(results: Path, pattern: str) -> list[dict]:
    """Every recorded point (one JSON line per server and rate) of the matching directories."""
    out = []
    for f in sorted(results.glob(f"churn/{pattern}/points.jsonl")):
        out += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return out


def plot_throughput_latency(results: Path, path: Path) -> int:
    fig, axes = plt.subplots(1, len(LOADS), figsize=(9, 3.6))
    n = 0
    for ax, (title, pattern) in zip(axes, LOADS.items(), strict=True):
        pts = churn_points(results, pattern)
        if pattern.startswith("agentic"):
            pts += churn_points(results, OVERLOAD)
        for system, color in COLORS.items():
            xy = sorted((p["throughput_rps"], p["normalized_latency_s_p90"] * 1e3)
                        for p in pts if p["system"] == system
                        and p.get("normalized_latency_s_p90") is not None)
            if xy:
                ax.plot(*zip(*xy, strict=True), "o", color=color, label=system)
                n += len(xy)
        ax.set(title=title, xlabel="requests finished / s",
               ylabel="P90 normalized latency (ms/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return n


def plot_swap_rates(results: Path, path: Path) -> int:
    rows = json.loads((results / "swap" / "swap_bandwidth.json").read_text())["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    n = 0
    methods = sorted({r["method"] for r in rows if r["chunks"]})
    for k, method in enumerate(methods):
        for way, style in (("in", "-o"), ("out", "--s"), ("in+out", ":^")):
            xy = sorted((r["chunks"], r["gbps"]) for r in rows
                        if r["method"] == method and r["dir"] == way and r["chunks"])
            if xy:
                ax.plot(*zip(*xy, strict=True), style, color=f"C{k}", label=f"{method} {way}")
                n += len(xy)
    ax.set(xscale="log", xlabel="chunks per step (random block ids)", ylabel="GB/s each way",
           title="Swaps between the tiers, H200 (13B GQA-10)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return n


def table_points(text: str) -> list[tuple[str, float, float, float, float]]:
    """(point, real req/s, simulated req/s, real P90, simulated P90) of a validation table;
    the simulated figures are those of its last model column."""
    out = []
    for block in re.split(r"\n(?=\S+ @ )", text.strip()):
        head, *lines = block.splitlines()
        vals = {}
        for label in ("throughput (req/s)", "P90 norm. latency (ms/tok)"):
            line = next((x for x in lines if x.startswith(label)), None)
            if line is None:
                break
            cells = line[len(label):].split()
            vals[label] = (float(cells[0].replace(",", "")), float(cells[-2].replace(",", "")))
        if len(vals) == 2:
            (rt, st), (rl, sl) = vals.values()
            out.append((head.split(" (")[0], rt, st, rl, sl))
    return out


def plot_sim_vs_real(results: Path, path: Path) -> int:
    pts = [p for name in SIM_TABLES
           for p in table_points((results / name / "table.txt").read_text())]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.6))
    for ax, (i, j, label) in zip(axes, ((1, 2, "requests finished / s"),
                                        (3, 4, "P90 normalized latency (ms/token)")), strict=True):
        real, sim = [p[i] for p in pts], [p[j] for p in pts]
        lo, hi = min(real + sim) * 0.9, max(real + sim) * 1.1
        ax.plot([lo, hi], [lo, hi], color="gray", lw=0.8)
        ax.plot(real, sim, "o")
        ax.set(xlabel=f"real: {label}", ylabel="simulated", xlim=(lo, hi), ylim=(lo, hi))
        ax.grid(alpha=0.3)
    fig.suptitle("The simulator against the real points it was validated on")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return len(pts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="docs/results")
    ap.add_argument("--out", default="docs/results/headline")
    args = ap.parse_args(argv)
    results, out = Path(args.results), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, fn in (("throughput_latency.png", plot_throughput_latency),
                     ("swap_rates.png", plot_swap_rates), ("sim_vs_real.png", plot_sim_vs_real)):
        n = fn(results, out / name)
        if n == 0:
            raise SystemExit(f"{name}: no recorded points found under {results}")
        print(f"wrote {out / name} ({n} points)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
