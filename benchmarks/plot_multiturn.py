"""Plots of multi-turn benchmark points, as the paper draws them.

    python benchmarks/plot_multiturn.py results/h200/points.jsonl --out docs/results/h200
        [--target-ms 180] [--tag TAG]

Writes ``<out>_throughput_latency.png`` (throughput vs P90 normalized latency, one line per
system), ``<out>_cache.png`` (prompt-token sources and recomputed tokens vs request rate) and,
when the points carry several think times, ``<out>_think_time.png``.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"pensieve": "tab:red", "gpu-only": "tab:orange", "lru": "tab:purple",
          "prefix-lru": "tab:green", "stateless": "tab:blue", "hf": "tab:gray"}


def load(path: str, tag: str | None) -> list[dict[str, Any]]:
    pts = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [p for p in pts if tag is None or p.get("tag") == tag]


def by_system(points: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for p in points:
        out[p["system"]].append(p)
    return {k: sorted(v, key=lambda p: p["conv_rate"]) for k, v in out.items()}


def plot_throughput_latency(points: list[dict[str, Any]], out: str, target_ms: float | None,
                            title: str) -> None:
    """Throughput vs P50 and P90 normalized latency; a point whose percentile is infinite
    (requests of the window still unfinished when the run stopped) is drawn as an x on top."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    finite = [(p.get(k) or 0) * 1e3 for p in points
              for k in ("normalized_latency_s_p50", "normalized_latency_s_p90")
              if p.get(k) is not None]
    top = max(finite + [target_ms or 0]) * 2 if finite else 1000.0
    for ax, key, name in ((axes[0], "normalized_latency_s_p50", "P50"),
                          (axes[1], "normalized_latency_s_p90", "P90")):
        for system, pts in by_system(points).items():
            xs = [p["throughput_rps"] for p in pts]
            ys = [p[key] * 1e3 if p.get(key) is not None else None for p in pts]
            ax.plot([x for x, y in zip(xs, ys) if y is not None],
                    [y for y in ys if y is not None], "o-", label=system,
                    color=COLORS.get(system))
            inf = [x for x, y in zip(xs, ys) if y is None]
            if inf:
                ax.plot(inf, [top] * len(inf), "x", color=COLORS.get(system), ms=9)
        if target_ms:
            ax.axhline(target_ms, ls=":", color="k", lw=1, label=f"target {target_ms:g} ms/token")
        ax.set_xlabel("throughput (requests/s)")
        ax.set_ylabel(f"{name} normalized latency (ms/token)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[1].legend(title="x: unfinished in window", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(f"{out}_throughput_latency.png", dpi=130)
    plt.close(fig)


def plot_cache(points: list[dict[str, Any]], out: str, title: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for system, pts in by_system(points).items():
        xs = [p["conv_rate"] for p in pts]
        hit = [(p.get("gpu_hit_rate") or 0) + (p.get("cpu_hit_rate") or 0) for p in pts]
        axes[0].plot(xs, hit, "o-", label=system, color=COLORS.get(system))
        axes[1].plot(xs, [p.get("recomputed_tokens", 0) for p in pts], "o-", label=system,
                     color=COLORS.get(system))
    axes[0].set_ylabel("context tokens served from cache (GPU + CPU)")
    axes[1].set_ylabel("recomputed history tokens")
    for ax in axes:
        ax.set_xlabel("conversation arrival rate (1/s)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(f"{out}_cache.png", dpi=130)
    plt.close(fig)


def plot_think_time(points: list[dict[str, Any]], out: str, title: str) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for p in points:
        groups[p["system"]].append(p)
    for system, pts in groups.items():
        pts.sort(key=lambda p: p["think_time_s"])
        ax.plot([p["think_time_s"] for p in pts], [p["throughput_rps"] for p in pts], "o-",
                label=system, color=COLORS.get(system))
    ax.set_xlabel("mean think time (s)")
    ax.set_ylabel("throughput at the latency target (req/s)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(f"{out}_think_time.png", dpi=130)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("points")
    ap.add_argument("--out", required=True)
    ap.add_argument("--target-ms", type=float, default=None)
    ap.add_argument("--tag", default=None)
    ap.add_argument("--title", default="")
    args = ap.parse_args()
    pts = load(args.points, args.tag)
    plot_throughput_latency(pts, args.out, args.target_ms, args.title)
    plot_cache(pts, args.out, args.title)
    if len({p["think_time_s"] for p in pts}) > 1:
        plot_think_time(pts, args.out, args.title)


if __name__ == "__main__":
    main()
