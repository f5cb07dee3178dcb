"""Unified vs separate prefill/decode batches on the multi-turn load (the paper's Figure 13).

    python benchmarks/batching.py --engine sim \
        --step-cost docs/results/multiturn_fused/step_cost_h200_fused.json --rates 1,2,3,4 \
        --think-time 60 --gpu-kv-gb 40 --cpu-kv-gb 220 --duration 600 --warmup 150 \
        --out results/batching

For each system of ``--systems`` (default ``pensieve``) and each mode of ``--modes`` (default
``unified,separate``), runs ``benchmarks/multiturn.py`` at every rate of ``--rates`` with
``--batching MODE``; every option this script does not know (``--engine real|sim``, the model,
the tiers, think time, duration, ...) goes to multiturn.py as is. Points are appended to
``<out>/points.jsonl`` (multiturn.py's records, each with its ``batching``), the plot
``<out>/batching_p90.png`` draws throughput against P90 normalized latency, one line per
(system, mode), and a table is printed (with each mode's capacity at ``--target-ms``).
``--plot-only`` redraws the plot and the table from ``<out>/points.jsonl`` (points of ``--tag``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from pensieve.bench.metrics import capacity_at

HERE = Path(__file__).resolve().parent


def load_multiturn() -> Any:
    spec = importlib.util.spec_from_file_location("multiturn", HERE / "multiturn.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def read_points(path: Path, skip: int = 0, tag: str | None = None) -> list[dict[str, Any]]:
    """Points of ``path`` after its first ``skip`` lines (of ``tag`` if given) that have a
    batching mode; a missing percentile (unfinished requests) becomes infinite."""
    if not path.exists():
        return []
    pts = [json.loads(line) for line in path.read_text().splitlines()[skip:] if line.strip()]
    pts = [p for p in pts if p.get("batching") and (tag is None or p.get("tag") == tag)]
    for p in pts:
        for k in ("normalized_latency_s_p50", "normalized_latency_s_p90", "ttft_s_p90"):
            if p.get(k) is None:
                p[k] = math.inf
    return pts


def group(points: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    out: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for p in points:
        out[(p["system"], p["batching"])].append(p)
    return {k: sorted(v, key=lambda p: p["conv_rate"]) for k, v in sorted(out.items())}


def plot(points: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    finite = [p["normalized_latency_s_p90"] * 1e3 for p in points
              if math.isfinite(p["normalized_latency_s_p90"])]
    top = max(finite) * 2 if finite else 1000.0
    systems = sorted({p["system"] for p in points})
    for (system, mode), pts in group(points).items():
        style = "o-" if mode == "unified" else "s--"
        color = f"C{systems.index(system)}"
        xs = [p["throughput_rps"] for p in pts]
        ys = [p["normalized_latency_s_p90"] * 1e3 for p in pts]
        ax.plot([x for x, y in zip(xs, ys) if math.isfinite(y)],
                [y for y in ys if math.isfinite(y)], style, color=color,
                label=f"{system}, {mode} batches")
        inf = [x for x, y in zip(xs, ys) if not math.isfinite(y)]
        if inf:
            ax.plot(inf, [top] * len(inf), "x", color=color, ms=9)
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("P90 normalized latency (ms/token)")
    if finite and max(finite) > 5 * min(finite):
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(title="x: unfinished in window", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def table(points: list[dict[str, Any]], target_ms: float) -> str:
    rows = ["| system | batching | rate (conv/s) | throughput (req/s) | P50 / P90 norm. latency "
            "(ms/token) | P90 TTFT (s) | unfinished |", "|" + " --- |" * 7]
    caps = []
    for (system, mode), pts in group(points).items():
        for p in pts:
            rows.append(f"| {system} | {mode} | {p['conv_rate']:g} | {p['throughput_rps']:.3f} | "
                        f"{p['normalized_latency_s_p50'] * 1e3:.1f} / "
                        f"{p['normalized_latency_s_p90'] * 1e3:.1f} | {p['ttft_s_p90']:.2f} | "
                        f"{p.get('unfinished', '')} |")
        caps.append(f"{system}, {mode} batches: {capacity_at(pts, target_ms / 1e3):.3f} req/s")
    return "\n".join(rows + ["", f"capacity at P90 {target_ms:g} ms/token:", *caps])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="pensieve")
    ap.add_argument("--modes", default="unified,separate")
    ap.add_argument("--rates", default="1,2,3,4", help="conversation arrivals per second")
    ap.add_argument("--out", default="results/batching")
    ap.add_argument("--tag", default="batching", help="label stored with every point")
    ap.add_argument("--target-ms", type=float, default=180.0,
                    help="P90 normalized latency target of the capacity lines")
    ap.add_argument("--plot-only", action="store_true")
    args, rest = ap.parse_known_args(argv)
    if "--batching" in rest or any(a.startswith("--batching=") for a in rest):
        ap.error("--batching is set per run by this script; give --modes")
    if "http" in rest or "--engine=http" in rest:
        ap.error("separate batches need Pensieve's own engine: --engine real or sim")
    if "hf" in args.systems.split(","):
        ap.error("the hf system has its own batching; give Pensieve cache policies")
    modes = args.modes.split(",")
    for m in modes:
        if m not in ("unified", "separate"):
            ap.error(f"unknown mode {m!r}")
    out = Path(args.out)
    points_file = out / "points.jsonl"
    if args.plot_only:
        points = read_points(points_file, tag=args.tag)
    else:
        skip = len(points_file.read_text().splitlines()) if points_file.exists() else 0
        multiturn = load_multiturn()
        for mode in modes:
            rc = multiturn.main([*rest, "--systems", args.systems, "--rates", args.rates,
                                 "--batching", mode, "--out", str(out), "--tag", args.tag])
            if rc:
                return int(rc)
        points = read_points(points_file, skip=skip)
    if not points:
        print(f"no points in {points_file}", file=sys.stderr)
        return 1
    engines = sorted({str(p.get("engine")) for p in points})
    plot(points, out / "batching_p90.png",
         f"unified vs separate batches ({', '.join(engines)}, {points[0].get('model')})")
    print(table(points, args.target_ms))
    print(f"points: {points_file}\nplot: {out / 'batching_p90.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
