"""Two builds' scheduler host time, run by run in turn: ``benchmarks/scheduler_cost.py``'s
workload (one size), each run in a fresh process under ``PYTHONPATH=<src>`` (the driver, this
directory's ``scheduler_cost.py``, is the same for both), builds alternating, then per build each
step's least thread CPU time over its runs and the median over steps.

    python benchmarks/scheduler_cost_ab.py --before /tmp/before/src --after src \\
        --sessions 300 --runs 8 [--share-prefixes] [--shared-prefix-tokens N] \\
        [--preset pressure] [--out results.json]

On a shared machine other load comes and goes within seconds; alternating the builds gives
both the same chances of a quiet run, and a step's least time over the runs (same work, step
by step) drops most of what that load added. A run: ``--warmup-steps`` 100 untimed steps and
300 timed ones, seed 0 (the benchmark's defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from scheduler_cost import min_step_median_ms

ONE_RUN = """
import argparse, json, sys
import scheduler_cost as sc
ap = argparse.ArgumentParser(); sc.add_arguments(ap)
a = sc.resolve(ap.parse_args(sys.argv[2:]))
b = sc.Bench(int(sys.argv[1]), a, seed=a.seed + int(sys.argv[1]))
for _ in range(a.warmup_steps): b.step()
print(json.dumps([b.step()[0] for _ in range(a.steps)]))
"""


def one_run(src: str, sessions: int, bench_args: list[str]) -> list[float]:
    here = str(Path(__file__).resolve().parent)  # scheduler_cost.py: the same driver for both
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, here]), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", ONE_RUN, str(sessions), *bench_args],
                         env=env, check=True, capture_output=True, text=True).stdout
    times: list[float] = json.loads(out)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="src/ of the first build")
    ap.add_argument("--after", required=True, help="src/ of the second build")
    ap.add_argument("--sessions", type=int, default=300)
    ap.add_argument("--runs", type=int, default=8, help="runs per build")
    ap.add_argument("--preset", default="pressure")
    ap.add_argument("--share-prefixes", action="store_true")
    ap.add_argument("--shared-prefix-tokens", type=int, default=0,
                    help="every session opens with the same N tokens (scheduler_cost.py's)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    bench_args = (["--preset", args.preset, "--shared-prefix-tokens",
                   str(args.shared_prefix_tokens)]
                  + (["--share-prefixes"] if args.share_prefixes else []))
    runs: dict[str, list[list[float]]] = {"before": [], "after": []}
    for _ in range(args.runs):
        for name in runs:
            src = str(Path(getattr(args, name)).resolve())
            runs[name].append(one_run(src, args.sessions, bench_args))
    rows = []
    for name, rs in runs.items():
        rows.append({"build": name, "src": getattr(args, name),
                     "min_step_median_ms": min_step_median_ms(rs),
                     "run_median_ms": sorted(statistics.median(x) * 1e3 for x in rs)})
        print(f"{name}: min-step median {rows[-1]['min_step_median_ms']:.3f} ms; run medians "
              + " ".join(f"{m:.3f}" for m in rows[-1]["run_median_ms"]), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"sessions": args.sessions, "preset": args.preset,
                                        "share_prefixes": args.share_prefixes,
                                        "runs": args.runs, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
