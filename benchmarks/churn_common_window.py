"""Churn points of separate calls, rescored over one common window.

    python benchmarks/churn_common_window.py A/churn.tgz B/churn.tgz ... [--out DIR]

``churn_points.sh`` cuts each call's window to what its budget leaves once the server is up, so
points of separate calls (one system per call) can have windows of different lengths. Under
overload that matters: a request sent late in a window may still be queued when the drain ends
and counts as never finished, and the longer a run goes, the longer its queue. This rescores
every point as if its run had ended with the shortest of them:

- arrivals stop at the common end ``E`` (the smallest ``duration_s``);
- the window is ``[warmup, E)``, the same for all;
- a request counts as finished only if it finished by ``E + drain`` (the smallest drain), as it
  would have in the shortest run; the rest count as infinitely slow
  (``pensieve.bench.metrics.summarize``).

It also reports each server's completion rate over ``[warmup, E)`` from its time series
(requests finished per second, whenever they were sent): under overload, the rate the system
serves at. Prints a table, writes ``common_window.json`` and ``common_window.png`` (requests
finished and waiting over time, the common window shaded) into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import io
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_totals import archive_files  # noqa: E402

from pensieve.bench.loadgen import LoadResult, RequestRecord  # noqa: E402
from pensieve.bench.metrics import summarize  # noqa: E402

_FIELDS = {f.name for f in dataclasses.fields(RequestRecord)}


def _members(path: str) -> dict[str, bytes]:
    """``<server>/<file>`` -> bytes, from a ``churn.tgz`` or an unpacked directory."""
    p = Path(path)
    if p.is_dir():
        return {str(f.relative_to(p)): f.read_bytes() for f in p.rglob("*") if f.is_file()}
    return {k.removeprefix("./"): v for k, v in archive_files(p).items()}


def load_runs(paths: list[str]) -> list[dict[str, Any]]:
    """One dict per server found: its point, request records and time series."""
    runs = []
    for path in paths:
        files = _members(path)
        for name in sorted(files):
            if not name.endswith("points.jsonl") or name.count("/") != 1:
                continue
            srv = name.split("/")[0]
            point = json.loads(files[name].decode().splitlines()[0])
            raw = files.get(f"{srv}/requests.jsonl.gz")
            if raw is None:
                raise SystemExit(f"{path}: no {srv}/requests.jsonl.gz")
            recs = [json.loads(line) for line in
                    io.TextIOWrapper(gzip.GzipFile(fileobj=io.BytesIO(raw)))]
            ts = files.get(f"{srv}/timeseries.jsonl")
            series = json.loads(ts.decode().splitlines()[0]) if ts else {}
            runs.append({"path": path, "point": point, "records": recs,
                         "samples": series.get("samples", []),
                         "drain_s": series.get("drain_s", point.get("drain_s"))})
    if not runs:
        raise SystemExit("no points found (expected <server>/points.jsonl in each input)")
    return runs


def rescore(run: dict[str, Any], end_s: float, cutoff_s: float) -> dict[str, Any]:
    """The point as if arrivals had stopped at ``end_s`` and the drain at ``cutoff_s``."""
    records = []
    for r in run["records"]:
        rec = RequestRecord(**{k: v for k, v in r.items() if k in _FIELDS})
        if rec.finished is not None and rec.finished > cutoff_s:
            rec.finished = None
            rec.output_tokens = None
            if rec.first_token is not None and rec.first_token > cutoff_s:
                rec.first_token = None
        records.append(rec)
    samples = [s for s in run["samples"] if s["t"] < end_s]
    unfinished = sum(r.finished is None for r in records)
    result = LoadResult(records, duration_s=end_s, end_s=cutoff_s, unfinished=unfinished,
                        samples=samples)
    return summarize(result, warmup_s=float(run["point"]["warmup_s"]))


def completion_rate(samples: list[dict[str, Any]], lo: float, hi: float) -> float | None:
    """Requests finished per second over ``[lo, hi)``, from the cumulative count."""
    inside = [s for s in samples if lo <= s["t"] < hi and "requests_finished" in s]
    if len(inside) < 2:
        return None
    a, b = inside[0], inside[-1]
    return (b["requests_finished"] - a["requests_finished"]) / max(b["t"] - a["t"], 1e-9)


def _fmt(v: Any, scale: float = 1.0, nd: int = 2) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    if v == float("inf"):
        return "inf"
    return f"{v * scale:,.{nd}f}"


def plot(runs: list[dict[str, Any]], lo: float, hi: float, out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        p, s = run["point"], run["samples"]
        label = f"{p['system']} @ {p['conv_rate']}"
        t = [x["t"] for x in s]
        ax1.plot(t, [x.get("requests_finished", 0) for x in s], label=label)
        ax2.plot(t, [x.get("requests_waiting", 0) for x in s], label=label)
    for ax, title in ((ax1, "requests finished (cumulative)"), (ax2, "requests waiting")):
        ax.axvspan(lo, hi, color="0.9", zorder=0)
        ax.set_xlabel("time (s)")
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"common window {lo:.0f}-{hi:.0f} s (shaded)")
    fig.tight_layout()
    path = out / "common_window.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help="churn.tgz files or unpacked directories")
    ap.add_argument("--out", default=None, help="where to write the JSON and the figure")
    args = ap.parse_args(argv)
    runs = load_runs(args.inputs)
    warmups = {float(r["point"]["warmup_s"]) for r in runs}
    if len(warmups) != 1:
        raise SystemExit(f"the points have different warm-ups ({sorted(warmups)}): "
                         "no common window")
    lo = warmups.pop()
    end = min(float(r["point"]["duration_s"]) for r in runs)
    drain = min(float(r["drain_s"] or 0.0) for r in runs)
    rows = []
    for run in runs:
        s = rescore(run, end, end + drain)
        p = run["point"]
        rows.append({
            "system": p["system"], "conv_rate": p["conv_rate"], "input": run["path"],
            "own_window_s": [lo, p["duration_s"]], "own_throughput_rps": p["throughput_rps"],
            "completion_rate_rps": completion_rate(run["samples"], lo, end),
            **{k: s[k] for k in ("window_s", "requests", "finished", "throughput_rps",
                                 "normalized_latency_s_p50", "normalized_latency_s_p90",
                                 "ttft_s_p50", "ttft_s_p90", "cpu_hit_rate",
                                 "recomputed_rate", "prefill_computed_tokens")}})
    head = (f"common window {lo:.0f}-{end:.0f} s, finished by {end + drain:.0f} s")
    print(head)
    cols = ("system @ rate", "own window", "own req/s", "req/s", "finished/sent",
            "completions/s", "P50 / P90 ms/token", "TTFT P50 s", "CPU hits / recomputed")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join((
            f"{r['system']} @ {r['conv_rate']}",
            f"{r['own_window_s'][0]:.0f}-{r['own_window_s'][1]:.0f}",
            _fmt(r["own_throughput_rps"]), _fmt(r["throughput_rps"]),
            f"{r['finished']} / {r['requests']}", _fmt(r["completion_rate_rps"]),
            f"{_fmt(r['normalized_latency_s_p50'], 1e3, 1)} / "
            f"{_fmt(r['normalized_latency_s_p90'], 1e3, 1)}",
            _fmt(r["ttft_s_p50"]),
            f"{_fmt(r['cpu_hit_rate'])} / {_fmt(r['recomputed_rate'])}")))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        doc = {"window_s": [lo, end], "finished_by_s": end + drain, "points": rows}
        (out / "common_window.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
        print(f"wrote {out / 'common_window.json'}, {plot(runs, lo, end, out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
