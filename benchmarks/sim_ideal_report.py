"""Tables and plot of ``benchmarks/sim_ideal.py``'s results (also on a saved JSON):

    python benchmarks/sim_ideal_report.py docs/results/sim_ideal/sim_ideal.json [--plot PNG]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

CONFIGS = (("prefix-lru", "ideal"), ("pensieve", "ideal"), ("pensieve-fp8", "ideal-fp8"))
"""Each configuration and the ideal of its own KV dtype."""


def ratios(caps: dict[str, dict[str, dict[str, float]]]) -> dict[str, dict[str, float | None]]:
    """``load@target`` -> configuration -> capacity (sessions/s) over its own ideal's, and
    ``<config>/best`` over the better ideal (None where an ideal carried nothing)."""
    out: dict[str, dict[str, float | None]] = {}
    for key, row in caps.items():
        best = max((row[i]["sessions_per_s"] for i in ("ideal", "ideal-fp8") if i in row),
                   default=0.0)
        r: dict[str, float | None] = {}
        for cfg, ideal in CONFIGS:
            if cfg not in row:
                continue
            own = row.get(ideal, {}).get("sessions_per_s", 0.0)
            c = row[cfg]["sessions_per_s"]
            r[cfg] = c / own if own else None
            r[f"{cfg}/best"] = c / best if best else None
        out[key] = r
    return out


def _f(x: Any, fmt: str = "{:.3f}") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else fmt.format(x)


BREAKDOWN_RATES = {"coding-agent": 0.07, "agent-mix": 0.16, "agentic": 1.3, "sharegpt": 1.3}
"""Sessions/s at which the second table splits each turn's time: a rate every system ran
(the coding-agent one is the real H200 points')."""


def _breakdown_rate(points: list[dict[str, Any]], wl: str, cap: float) -> float | None:
    """:data:`BREAKDOWN_RATES`'s rate of ``wl``, else the highest simulated rate at or under
    ``cap`` (pensieve bf16's capacity at the middle target), else the least."""
    rs = sorted({p["conv_rate"] for p in points if p["workload"] == wl})
    if BREAKDOWN_RATES.get(wl) in rs:
        return BREAKDOWN_RATES[wl]
    under = [r for r in rs if r <= cap + 1e-9]
    return under[-1] if under else (rs[0] if rs else None)


def _at_least(points: list[dict[str, Any]], wl: str, system: str, target: float) -> bool:
    """Whether ``system``'s highest simulated rate of ``wl`` still met ``target``: its
    capacity is then at least that rate, not bracketed."""
    ps = [p for p in points if p["workload"] == wl and p["system"] == system]
    top = max(ps, key=lambda p: p["conv_rate"], default=None)
    return top is not None and top["ttft_s_p90"] is not None and top["ttft_s_p90"] <= target


def markdown(doc: dict[str, Any]) -> str:
    caps, points = doc["capacity_at_p90_ttft"], doc["points"]
    rat = doc.get("capacity_over_ideal") or ratios(caps)
    systems = ("prefix-lru", "pensieve", "pensieve-fp8", "ideal", "ideal-fp8")
    lines = ["Capacity (sessions/s; `>=`: the highest rate simulated still met the target) and "
             "capacity / ideal:", "",
             "| load @ P90 TTFT | " + " | ".join(systems) + " | prefix-lru / ideal "
             "| pensieve / ideal | pensieve-fp8 / ideal-fp8 | best config / best ideal |",
             "| --- | " + " | ".join("---:" for _ in systems) + " | ---: | ---: | ---: | ---: |"]
    for key, row in sorted(caps.items()):
        r = rat[key]
        wl, target = key.split("@")[0], float(key.split("@")[1].rstrip("s"))
        best_cfg = max((r.get(f"{c}/best") or 0.0 for c, _ in CONFIGS if c in row), default=0.0)
        lines.append(f"| {key} | " + " | ".join(
            (">= " if _at_least(points, wl, s, target) else "")
            + _f(row.get(s, {}).get("sessions_per_s")) for s in systems)
                     + f" | {_f(r.get('prefix-lru'), '{:.2f}')} | {_f(r.get('pensieve'), '{:.2f}')}"
                     f" | {_f(r.get('pensieve-fp8'), '{:.2f}')} | {_f(best_cfg, '{:.2f}')} |")
    lines += ["", "Where a turn's simulated GPU time goes (seconds per finished turn, whole run; "
              "`busy` = prefill + recompute + other + host + copy wait):", "",
              "| load @ sessions/s | system | P90 TTFT s | busy | prefill (new) | recompute | "
              "other (weights, decode, KV reads) | host | copy wait | recomputed share of "
              "prefill |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    targets = sorted({float(k.split("@")[1].rstrip("s")) for k in caps})
    mid = targets[len(targets) // 2] if targets else 2.0
    for wl in sorted({p["workload"] for p in points}):
        cap = caps.get(f"{wl}@{mid:g}s", {}).get("pensieve", {}).get("sessions_per_s", 0.0)
        rate = _breakdown_rate(points, wl, cap)
        for s in systems:
            ps = [p for p in points if p["workload"] == wl and p["system"] == s
                  and p["conv_rate"] == rate]
            if not ps:
                continue
            p, b = ps[0], ps[0]["breakdown"]
            comp = p.get("prefill_computed_tokens") or 0
            share = p.get("recomputed_tokens", 0) / comp if comp else 0.0
            lines.append(f"| {wl} @ {rate:g} | {s} | {_f(p['ttft_s_p90'], '{:.2f}')} | "
                         + " | ".join(_f(b[k]) for k in ("busy", "prefill", "recompute",
                                                         "other", "host", "copy_wait"))
                         + f" | {share:.2f} |")
    return "\n".join(lines) + "\n"


def plot(rat: dict[str, dict[str, float | None]], path: Path) -> None:
    """Capacity / own ideal per load (panels) and P90 TTFT target (x), one line a config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted({k.split("@")[0] for k in rat})
    fig, axes = plt.subplots(1, len(loads), figsize=(2.6 * len(loads), 2.8), dpi=64,
                             squeeze=False, sharey=True)
    for ax, wl in zip(axes[0], loads):
        keys = sorted((k for k in rat if k.split("@")[0] == wl),
                      key=lambda k: float(k.split("@")[1].rstrip("s")))
        xs = list(range(len(keys)))  # the targets, evenly spaced
        for cfg, _ in CONFIGS:
            ys = [rat[k].get(cfg) for k in keys]
            ax.plot(xs, [y if y is not None else float("nan") for y in ys], "o-", ms=3,
                    label=cfg)
        ax.axhline(0.8, color="grey", ls=":", lw=0.8)
        ax.set_ylim(0, 1.1)
        ax.set_xticks(xs, [k.split("@")[1] for k in keys])
        ax.set_title(wl, fontsize=9)
        ax.set_xlabel("P90 TTFT target (s)", fontsize=8)
    axes[0][0].set_ylabel("capacity / ideal", fontsize=8)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", type=Path)
    ap.add_argument("--plot", type=Path, default=None)
    a = ap.parse_args(argv)
    doc = json.loads(a.json.read_text())
    print(markdown(doc))
    if a.plot:
        plot(doc.get("capacity_over_ideal") or ratios(doc["capacity_at_p90_ttft"]), a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
