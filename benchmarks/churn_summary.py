"""Side-by-side summary of multi-turn points (e.g. the two servers of churn_points.sh).

    python benchmarks/churn_summary.py results/churn/points.jsonl [--tag TAG]

One column per point (system @ rate), one row per number: throughput, latency percentiles,
prefill computed vs cached, where the context came from, the client's HTTP counters and the
steady-state check (the means of the window's halves, the 10% flag and the noise-aware one;
``pensieve.bench.run_metrics.steady_state``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _f(v: Any, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    if v is None:
        return "inf/-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, float)):
        return fmt.format(v * scale)
    return str(v)


def _halves(p: dict[str, Any], key: str, fmt: str = "{:.1f}") -> str:
    h = (p.get("steady") or {}).get("halves", {}).get(key)
    if not h:
        return "-"
    a, b = h
    return f"{_f(a, fmt=fmt)} -> {_f(b, fmt=fmt)}"


_SHORT = {"sessions_in_flight": "sessions", "gpu_blocks_used": "gpu", "cpu_blocks_used": "cpu",
          "requests_running": "running", "requests_waiting": "waiting"}

ROWS: list[tuple[str, Any]] = [
    ("engine / api", lambda p: f"{p.get('engine')} / {p.get('api') or '-'}"),
    ("workload", lambda p: p.get("workload", "-")),
    ("window (s)", lambda p: f"{p.get('warmup_s'):g}-{p.get('duration_s'):g}"),
    ("finished / sent in window", lambda p: f"{p['finished']} / {p['requests']}"),
    ("unfinished at the end (all)", lambda p: p.get("unfinished")),
    ("throughput (req/s)", lambda p: _f(p["throughput_rps"])),
    ("output tokens/s", lambda p: _f(p.get("output_tokens_per_s"), fmt="{:.0f}")),
    ("prompt tokens/s (context)", lambda p: _f(p.get("prompt_tokens_per_s"), fmt="{:.0f}")),
    ("P50 / P90 norm. latency (ms/token)",
     lambda p: f"{_f(p['normalized_latency_s_p50'], 1e3, '{:.1f}')} / "
               f"{_f(p['normalized_latency_s_p90'], 1e3, '{:.1f}')}"),
    ("P50 / P90 TTFT (s)",
     lambda p: f"{_f(p['ttft_s_p50'], fmt='{:.3f}')} / {_f(p['ttft_s_p90'], fmt='{:.3f}')}"),
    ("P50 / P90 latency (s)",
     lambda p: f"{_f(p['latency_s_p50'])} / {_f(p['latency_s_p90'])}"),
    ("mean context (tokens)", lambda p: _f(p.get("mean_context_len"), fmt="{:.0f}")),
    ("prefill computed / cached (tokens)",
     lambda p: f"{_f(p.get('prefill_computed_tokens'), fmt='{:,.0f}')} / "
               f"{_f(p.get('prefill_cached_tokens'), fmt='{:,.0f}')}"),
    ("prefill computed tokens/s", lambda p: _f(p.get("prefill_computed_tokens_per_s"),
                                               fmt="{:.0f}")),
    ("prefill computed per turn (tokens)",
     lambda p: _f(p.get("prefill_computed_per_turn"), fmt="{:,.0f}")),
    ("context from GPU / shared / CPU / disk / recomputed / new",
     lambda p: " / ".join(_f(p.get(k)) for k in (
         "gpu_hit_rate", "shared_hit_rate", "cpu_hit_rate", "disk_hit_rate", "recomputed_rate",
         "new_prompt_rate"))),
    ("KV blocks held per session in flight (window)",
     lambda p: _f((p.get("steady") or {}).get("kv_blocks_per_session"), fmt="{:.1f}")),
    ("steady (10%) / within noise",
     lambda p: f"{_f(p.get('steady_state'))} / "
               f"{_f((p.get('steady') or {}).get('steady_within_noise'))}"),
    ("  moved > 10%",
     lambda p: ",".join(_SHORT.get(k, k) for k in (p.get("steady") or {}).get("unsteady", []))
     or "-"),
    ("  sessions arrived/s (halves)", lambda p: _halves(p, "sessions_arrived_per_s", "{:.2f}")),
    ("  sessions in flight (halves)", lambda p: _halves(p, "sessions_in_flight")),
    ("  GPU blocks used (halves)", lambda p: _halves(p, "gpu_blocks_used", "{:.0f}")),
    ("  CPU blocks used (halves)", lambda p: _halves(p, "cpu_blocks_used", "{:.0f}")),
    ("  requests running (halves)", lambda p: _halves(p, "requests_running")),
    ("  requests waiting (halves)", lambda p: _halves(p, "requests_waiting")),
    ("  throughput req/s (halves)", lambda p: _halves(p, "throughput_rps", "{:.2f}")),
    ("http errors / history misses",
     lambda p: f"{p.get('http_errors', '-')} / {p.get('http_history_misses', '-')}"),
    ("http peak in flight / throttled",
     lambda p: f"{p.get('http_peak_in_flight', '-')} / {p.get('http_throttled', '-')}"),
    ("prompt tokens per word", lambda p: p.get("tokens_per_word", "-")),
    ("wall (s)", lambda p: p.get("wall_s")),
]


def table(points: list[dict[str, Any]]) -> str:
    head = ["metric"] + [f"{p['system']} @ {p['conv_rate']:g}/s" for p in points]
    rows = [head]
    for label, fn in ROWS:
        row = [label]
        for p in points:
            try:
                row.append(str(fn(p)))
            except (KeyError, TypeError, ValueError):
                row.append("-")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = []
    for j, r in enumerate(rows):
        lines.append("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i])
                               for i, c in enumerate(r)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("points", nargs="+")
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)
    pts = []
    for path in args.points:
        pts += [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    pts = [p for p in pts if args.tag is None or p.get("tag") == args.tag]
    if not pts:
        print("no points")
        return 1
    print(table(pts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
