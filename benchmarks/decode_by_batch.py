"""Decode-only steps of serving runs side by side, at matched batch sizes.

Two runs of one load rarely hold the same batches: a faster engine finishes requests sooner
and so runs fewer at once, which by itself shortens its decode steps. This bins each run's
decode-only steps (no prefill token) in a window by their decode count and prints, per bin
held by every run, the steps and their median time, and each run's time over the first
run's; ``quiet`` keeps the steps with no copies ahead and no swap-outs in flight. Input: a
``churn.tgz`` of ``benchmarks/churn_points.sh`` or a ``steps.jsonl(.gz)`` per run.

    python benchmarks/decode_by_batch.py A/churn.tgz B/churn.tgz --labels head direct \\
        --window 200 500 --plot decode_by_batch.png
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from step_breakdown import load_rows


def decode_bins(rows: list[dict[str, Any]], window: tuple[float, float], width: int,
                quiet: bool = False) -> dict[int, list[float]]:
    """Step seconds of the decode-only steps that started in ``window`` (s since the
    server's start), by ``decode_tokens // width * width``."""
    bins: dict[int, list[float]] = {}
    for r in rows:
        if r["prefill_tokens"] or not r["decode_tokens"]:
            continue
        if not window[0] <= r.get("t", 0.0) <= window[1]:
            continue
        if quiet and (r.get("swap_in_ahead", 0) or r.get("swap_outs_in_flight", 0)):
            continue
        bins.setdefault(r["decode_tokens"] // width * width, []).append(r["step_time_s"])
    return bins


def compare(runs: list[dict[int, list[float]]], labels: list[str], width: int,
            min_steps: int) -> list[dict[str, Any]]:
    """One row per bin with at least ``min_steps`` steps in every run: the steps and median
    ms per run, and the medians over the first run's."""
    common = sorted(set.intersection(*(set(b) for b in runs)))
    rows = []
    for lo in common:
        if min(len(b[lo]) for b in runs) < min_steps:
            continue
        ms = [statistics.median(b[lo]) * 1e3 for b in runs]
        rows.append({"batch": f"{lo}-{lo + width - 1}", "lo": lo,
                     "steps": {lab: len(b[lo]) for lab, b in zip(labels, runs, strict=True)},
                     "ms": dict(zip(labels, ms, strict=True)),
                     "ratio": {lab: m / ms[0] for lab, m in zip(labels, ms, strict=True)}})
    return rows


def table(rows: list[dict[str, Any]], labels: list[str]) -> str:
    cols = [f"{lab} steps" for lab in labels] + [f"{lab} ms" for lab in labels]
    cols += [f"{lab} / {labels[0]}" for lab in labels[1:]]
    widths = [max(10, len(c) + 2) for c in cols]
    lines = [f"{'decodes':>9}" + "".join(f"{c:>{w}}" for c, w in zip(cols, widths, strict=True))]
    for r in rows:
        cells = [str(r["steps"][lab]) for lab in labels]
        cells += [f"{r['ms'][lab]:.2f}" for lab in labels]
        cells += [f"{r['ratio'][lab]:.3f}" for lab in labels[1:]]
        lines.append(f"{r['batch']:>9}" + "".join(f"{c:>{w}}"
                                                 for c, w in zip(cells, widths, strict=True)))
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], labels: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for lab in labels:
        ax.plot([r["lo"] for r in rows], [r["ms"][lab] for r in rows], marker="o", label=lab)
    ax.set_xlabel("decodes in the step (bin start)")
    ax.set_ylabel("median decode-only step (ms)")
    ax.set_title("decode-only steps at matched batch sizes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+", help="churn.tgz or steps.jsonl(.gz), one per run")
    ap.add_argument("--labels", nargs="+", default=None)
    ap.add_argument("--window", type=float, nargs=2, default=(0.0, float("inf")),
                    metavar=("T0", "T1"), help="seconds since each server's start")
    ap.add_argument("--width", type=int, default=10, help="decodes per bin")
    ap.add_argument("--min-steps", type=int, default=50)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    labels = args.labels or [f"run{i}" for i in range(len(args.logs))]
    if len(labels) != len(args.logs):
        ap.error(f"{len(labels)} labels for {len(args.logs)} runs")
    if args.width < 1:
        ap.error("--width must be >= 1")
    loaded = [load_rows(p) for p in args.logs]
    for quiet in (False, True):
        runs = [decode_bins(r, tuple(args.window), args.width, quiet) for r in loaded]
        rows = compare(runs, labels, args.width, args.min_steps)
        print(("quiet: no copies ahead, no swap-outs in flight" if quiet
               else "all decode-only steps") + f", window {args.window[0]:g}-"
              f"{args.window[1]:g} s\n" + table(rows, labels) + "\n")
        if args.plot and not quiet and rows:
            plot(rows, labels, args.plot)
            print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
