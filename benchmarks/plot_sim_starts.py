"""How the start of a simulated run decides its state near saturation: sessions in flight and
requests waiting over time (50 s means, the points' ``ramp``) for the same system and load
started cold and warm, one panel per (system, rate), one line per run.

    python benchmarks/plot_sim_starts.py \
        docs/results/sim_sharegpt_40_60_start/*/sim_churn_capacity.json \
        docs/results/sim_sharegpt_40_60_warm/sim_churn_capacity.json \
        --only stateless:0.75,pensieve:0.9 --out docs/results/sim_sharegpt_40_60_start/starts.png

Each run is labelled by its start (``cold`` or ``warm S_PER_TOKEN``), its length and, unless it
is the engine's, its swap-or-recompute rule (``--recompute-rule``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def load_points(paths: list[str]) -> list[dict[str, Any]]:
    out = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        for p in doc["points"] if isinstance(doc, dict) else doc:
            if p.get("ramp"):
                out.append(p)
    return out


def label(p: dict[str, Any]) -> str:
    warm = p.get("warm_start_s_per_token")
    start = "cold" if warm is None else f"warm {warm:g} s/token"
    rule = p.get("recompute_rule") or "step"
    return f"{start}, {p['ramp'][-1]['t'] + 50:.0f} s" + ("" if rule == "step" else f", {rule}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+", help="sim_churn_capacity.json files")
    ap.add_argument("--only", required=True, metavar="SYSTEM:RATE,...",
                    help="the (system, rate) panels to draw")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    panels = [(s, float(r)) for s, r in (x.split(":") for x in args.only.split(","))]
    points = load_points(args.json)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(panels), figsize=(5 * len(panels), 6.5), squeeze=False,
                             sharex="col")
    for j, (system, rate) in enumerate(panels):
        runs = [p for p in points if p["system"] == system and abs(p["conv_rate"] - rate) < 1e-9]
        if not runs:
            print(f"no run of {system} at {rate:g}/s in the files given", file=sys.stderr)
            return 2
        for p in sorted(runs, key=label):
            ts = [r["t"] for r in p["ramp"]]
            for i, key in enumerate(("sessions_in_flight", "requests_waiting")):
                axes[i][j].plot(ts, [r[key] for r in p["ramp"]], label=label(p))
        axes[0][j].set_title(f"{system} @ {rate:g} sessions/s")
        axes[1][j].set_xlabel("time since the first arrival (s)")
        for i in range(2):
            axes[i][j].grid(alpha=0.3)
        axes[0][j].legend(fontsize=7)
    axes[0][0].set_ylabel("sessions in flight (50 s means)")
    axes[1][0].set_ylabel("requests waiting (50 s means)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
