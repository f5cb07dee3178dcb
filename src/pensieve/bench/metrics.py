"""Per-run metrics from request records: throughput, latency percentiles, cache hit rates.

The measurement window holds the requests *sent* in ``[warmup_s, duration_s)``. Throughput is
the number of them that finished over the window's length; requests that never finished count
as infinitely slow in the latency percentiles, so an overloaded system cannot look fast by
completing only its easy requests.
"""

from __future__ import annotations

import math
from typing import Any

from pensieve.bench.loadgen import LoadResult, RequestRecord

_SOURCES = ("gpu_hit_tokens", "cpu_hit_tokens", "recomputed_tokens", "new_prompt_tokens")


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); inf propagates; nan when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    if xs[hi] == math.inf:
        return math.inf if pos > lo or xs[lo] == math.inf else xs[lo]
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def window(result: LoadResult, warmup_s: float) -> list[RequestRecord]:
    return [r for r in result.records if warmup_s <= r.sent < result.duration_s]


def summarize(result: LoadResult, warmup_s: float = 0.0) -> dict[str, Any]:
    """The run's numbers over its measurement window."""
    recs = window(result, warmup_s)
    span = max(result.duration_s - warmup_s, 1e-9)
    done = [r for r in recs if r.finished is not None]
    lat = [r.latency if r.latency is not None else math.inf for r in recs]
    norm = [r.normalized_latency if r.normalized_latency is not None else math.inf
            for r in recs]
    ttft = [r.ttft if r.ttft is not None else math.inf for r in recs]
    out: dict[str, Any] = {
        "requests": len(recs),
        "finished": len(done),
        "errors": sum(r.error for r in recs),
        "window_s": round(span, 3),
        "throughput_rps": len(done) / span,
        "output_tokens_per_s": sum(r.output_len for r in done) / span,
    }
    for name, xs in (("latency_s", lat), ("normalized_latency_s", norm), ("ttft_s", ttft)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = percentile(xs, q)
    ctx = sum(sum(r.cache.get(k, 0) for k in _SOURCES) for r in done)
    for k in _SOURCES:
        tokens = sum(r.cache.get(k, 0) for r in done)
        out[k] = tokens
        out[k.replace("_tokens", "_rate")] = tokens / ctx if ctx else math.nan
    out["mean_context_len"] = sum(r.context_len for r in done) / len(done) if done else math.nan
    return out


def capacity_at(points: list[dict[str, Any]], target_s: float,
                key: str = "normalized_latency_s_p90") -> float:
    """Highest throughput whose P90 normalized latency meets ``target_s``, interpolating
    linearly between the last point under the target and the first one over it."""
    pts = sorted(points, key=lambda p: p["throughput_rps"])
    best = 0.0
    for a, b in zip(pts, pts[1:] + [None]):
        if a[key] <= target_s:
            best = max(best, a["throughput_rps"])
            if b is not None and b[key] > target_s and math.isfinite(b[key]):
                frac = (target_s - a[key]) / (b[key] - a[key])
                best = max(best, a["throughput_rps"]
                           + frac * (b["throughput_rps"] - a["throughput_rps"]))
    return best
