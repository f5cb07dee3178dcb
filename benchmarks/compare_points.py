"""Simulator against real points: the same systems, rates and set-up, side by side.

    python benchmarks/compare_points.py REAL_POINTS.jsonl SIM_POINTS.jsonl

Matches points by (system, conversation rate) and prints throughput, P50 normalized latency,
mean latency of finished requests and the GPU hit rate for both, with relative errors.
"""

from __future__ import annotations

import argparse
import json
import statistics


def load(path: str) -> dict[tuple[str, float], dict]:
    out = {}
    for line in open(path):
        p = json.loads(line)
        out[(p["system"], p["conv_rate"])] = p
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("real")
    ap.add_argument("sim")
    args = ap.parse_args()
    real, sim = load(args.real), load(args.sim)
    keys = [("throughput_rps", "req/s", 1.0), ("normalized_latency_s_p50", "ms/tok", 1e3),
            ("latency_s_p50", "s", 1.0), ("gpu_hit_rate", "", 1.0)]
    print("| system | rate | " + " | ".join(f"{k} real / sim" for k, _, _ in keys) + " |")
    print("|" + " --- |" * (2 + len(keys)))
    errs: dict[str, list[float]] = {k: [] for k, _, _ in keys}
    for key in sorted(real):
        if key not in sim:
            continue
        r, s = real[key], sim[key]
        cells = []
        for k, _unit, scale in keys:
            a, b = r.get(k), s.get(k)
            if a is None or b is None:
                cells.append("-")
                continue
            cells.append(f"{a * scale:.3g} / {b * scale:.3g}")
            if a:
                errs[k].append(abs(b - a) / abs(a))
        print(f"| {key[0]} | {key[1]:g} | " + " | ".join(cells) + " |")
    print()
    for k, es in errs.items():
        if es:
            print(f"{k}: median relative error {statistics.median(es):.1%}, "
                  f"max {max(es):.1%} over {len(es)} points")


if __name__ == "__main__":
    main()
