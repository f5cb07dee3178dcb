"""Throughput each system sustains at a P90 normalized-latency target, and the ratios.

    python benchmarks/capacity.py POINTS.jsonl --target-ms 180 [--tag TAG]

For each system, the highest throughput whose P90 normalized latency meets the target,
interpolated between the last point under it and the first point over it
(`pensieve.bench.run_metrics.capacity_at`); then each system's capacity over stateless and over
prefix-lru. A point with an infinite P90 (unfinished requests) counts as over the target.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict

from pensieve.bench.run_metrics import capacity_at


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("points")
    ap.add_argument("--target-ms", type=float, default=180.0)
    ap.add_argument("--tag", default=None)
    args = ap.parse_args()
    by: dict[str, list[dict]] = defaultdict(list)
    for line in open(args.points):
        p = json.loads(line)
        if args.tag and p.get("tag") != args.tag:
            continue
        if p.get("normalized_latency_s_p90") is None:
            p["normalized_latency_s_p90"] = math.inf
        by[p["system"]].append(p)
    target = args.target_ms / 1e3
    cap = {s: capacity_at(pts, target) for s, pts in by.items()}
    print(f"| system | points (req/s : P90 ms/token) | capacity at {args.target_ms:g} ms/token "
          "(req/s) | vs stateless | vs prefix-lru |")
    print("| --- | --- | --- | --- | --- |")
    for s in sorted(by):
        pts = sorted(by[s], key=lambda p: p["throughput_rps"])
        desc = ", ".join(f"{p['throughput_rps']:.2f} : {p['normalized_latency_s_p90'] * 1e3:.0f}"
                         for p in pts)
        ratios = [f"{cap[s] / cap[ref]:.2f}x" if cap.get(ref) else "-"
                  for ref in ("stateless", "prefix-lru")]
        print(f"| {s} | {desc} | {cap[s]:.2f} | {ratios[0]} | {ratios[1]} |")


if __name__ == "__main__":
    main()
