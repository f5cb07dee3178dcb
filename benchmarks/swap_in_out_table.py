"""The in + out rows of ``benchmarks/swap_out_order.sh``'s runs side by side: per run (file
``bw_<order>_g<groups>_<round>.json``, or ``bw_<order>_<round>.json`` from before the groups
of layers), the raw two-stream rate of the same call, GB/s each way of the staged swapper's
in + out (and out alone) at each size, and when the step's swap-ins were done; with
``swap_bandwidth.py --steps K``, the same for K in + out steps back to back (``xK``: the rate
each way over the K steps, and the median step's swap-ins done); then the range per order,
groups and size.

    python benchmarks/swap_in_out_table.py results_tmp/ > results_tmp/in_out_table.txt
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

_NAME = re.compile(r"bw_(?P<order>[a-z]+)(?:_g(?P<groups>\d+))?_(?P<round>\d+)\.json$")


def load(folder: Path) -> list[dict]:
    """One record per run: order, groups, round, raw two-stream rate, and per size the in +
    out rate, out alone and the swap-ins' done time."""
    runs = []
    for path in sorted(folder.glob("bw_*.json")):
        m = _NAME.search(path.name)
        if m is None:
            continue
        rows = json.loads(path.read_text())["rows"]
        raw = next((r["gbps"] for r in rows if r["method"] == "raw 2 streams"), float("nan"))
        sizes: dict[int, dict[str, float]] = defaultdict(dict)
        for r in rows:
            if r["method"] != "staged":
                continue
            cell = sizes[r["chunks"]]
            if r["dir"] in ("in+out", "out"):
                cell[r["dir"]] = r["gbps"]
                if r["dir"] == "in+out":
                    cell["ins_ms"] = r["step_s"] * 1e3
            elif r["dir"].startswith("in+out x"):
                cell["steps"] = r["steps"]
                cell["steps_gbps"] = r["gbps"]
                cell["steps_ins_ms"] = r["step_s"] * 1e3
        runs.append({"order": m["order"], "groups": int(m["groups"] or 1),
                     "round": int(m["round"]), "raw": raw, "sizes": dict(sizes)})
    return runs


def table(runs: list[dict]) -> str:
    lines = []
    for r in runs:
        cells = " | ".join(f"{n}: {s['in+out']:.1f} GB/s (out alone {s.get('out', 0):.1f}), "
                           f"ins {s['ins_ms']:.2f} ms{_steps_cell(s)}"
                           for n, s in sorted(r["sizes"].items()))
        lines.append(f"{r['order']:>5} g{r['groups']} r{r['round']}  raw two-stream "
                     f"{r['raw']:.1f} | {cells}")
    groups: dict[tuple[str, int, int], list[tuple[float, float, float, float]]] = defaultdict(list)
    steps: dict[tuple[str, int, int, int], list[tuple[float, float, float]]] = defaultdict(list)
    for r in runs:
        for n, s in r["sizes"].items():
            groups[(r["order"], r["groups"], n)].append(
                (s["in+out"], s["in+out"] / r["raw"], s["ins_ms"], s.get("out", float("nan"))))
            if "steps" in s:
                steps[(r["order"], r["groups"], n, s["steps"])].append(
                    (s["steps_gbps"], s["steps_gbps"] / r["raw"], s["steps_ins_ms"]))
    lines.append("")
    for (order, g, n), v in sorted(groups.items()):
        gb, of_raw, ins, out = zip(*v, strict=True)
        lines.append(f"{order:>5} g{g} {n:>5} chunks: in + out {min(gb):.1f}-{max(gb):.1f} "
                     f"GB/s each way (median {statistics.median(gb):.1f}, {len(gb)} runs), "
                     f"of raw {min(of_raw):.0%}-{max(of_raw):.0%}; out alone "
                     f"{min(out):.1f}-{max(out):.1f}; swap-ins done {min(ins):.2f}-"
                     f"{max(ins):.2f} ms")
    for (order, g, n, k), v in sorted(steps.items()):
        gb, of_raw, ins = zip(*v, strict=True)
        lines.append(f"{order:>5} g{g} {n:>5} chunks x{k} steps: in + out {min(gb):.1f}-"
                     f"{max(gb):.1f} GB/s each way (median {statistics.median(gb):.1f}, "
                     f"{len(gb)} runs), of raw {min(of_raw):.0%}-{max(of_raw):.0%}; a step's "
                     f"swap-ins done {min(ins):.2f}-{max(ins):.2f} ms")
    return "\n".join(lines)


def _steps_cell(s: dict[str, float]) -> str:
    if "steps" not in s:
        return ""
    return (f"; x{s['steps']:.0f} steps {s['steps_gbps']:.1f} GB/s, ins "
            f"{s['steps_ins_ms']:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    print(table(load(ap.parse_args().folder)))


if __name__ == "__main__":
    main()
