"""Per-run metrics from request records: throughput, latency percentiles, cache hit rates.

The measurement window holds the requests *sent* in ``[warmup_s, duration_s)``. Throughput is
the number of them that finished over the window's length; requests that never finished count
as infinitely slow in the latency percentiles, so an overloaded system cannot look fast by
completing only its easy requests.

Prefill: ``prefill_computed_tokens`` (recomputed history + new input) against
``prefill_cached_tokens`` (served from the GPU or CPU tier), from each turn's cache stats, or,
for a server that reports only ``usage.prompt_tokens_details.cached_tokens``, from that.

Steady state (:func:`steady_state`): the run's samples (one a second) inside the window are
split into its first and second half, and each quantity's mean is compared between halves.
The window is called steady (``steady_state``) when every one of sessions in flight, GPU
blocks used, CPU blocks used, requests running and requests waiting moved by at most 10% (of
the larger of the two means) plus a small floor -- one session or request, 1% of the tier's
blocks -- so that near-zero quantities (an empty queue) do not fail on noise. A queue that
keeps growing, a tier still filling or a population of sessions still ramping up all fail it.
So can the arrivals' own noise: with a few sessions a second, the number in flight differs
between two 2-minute halves by 10-20% at steady state. ``steady.steady_within_noise`` also
accepts a quantity whose difference is within two standard errors estimated from the window's
scatter around a trend (see :func:`steady_state`).
"""

from __future__ import annotations

import math
from typing import Any

from pensieve.bench.loadgen import LoadResult, RequestRecord

_SOURCES = ("gpu_hit_tokens", "shared_hit_tokens", "cpu_hit_tokens", "disk_hit_tokens",
            "recomputed_tokens", "new_prompt_tokens")
"""Where a turn's context came from (:class:`~pensieve.core.stats.CacheStats`): each token in
exactly one."""
_CACHED = ("gpu_hit_tokens", "shared_hit_tokens", "cpu_hit_tokens", "disk_hit_tokens")


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
    out_tokens = [r.output_tokens if r.output_tokens is not None else r.output_len for r in done]
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
        "output_tokens_per_s": sum(out_tokens) / span,
        "prompt_tokens_per_s": sum(r.context_len for r in done) / span,
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
    computed = cached = 0
    known = False
    for r in done:
        if any(k in r.cache for k in _SOURCES):
            known = True
            cached += sum(r.cache.get(k, 0) for k in _CACHED)
            computed += r.cache.get("recomputed_tokens", 0) + r.cache.get("new_prompt_tokens", 0)
        elif "usage_cached_tokens" in r.cache:
            known = True
            cached += r.cache["usage_cached_tokens"]
            computed += max(r.context_len - r.cache["usage_cached_tokens"], 0)
    out["prefill_computed_tokens"] = computed if known else None
    out["prefill_cached_tokens"] = cached if known else None
    out["prefill_cached_rate"] = (cached / (cached + computed)
                                  if known and cached + computed else math.nan)
    out["prefill_computed_tokens_per_s"] = computed / span if known else math.nan
    out["prefill_computed_per_turn"] = computed / len(done) if known and done else math.nan
    if result.samples:
        st = steady_state(result, warmup_s)
        out["steady_state"] = st["steady"]
        out["steady"] = st
    return out


STEADY_KEYS = ("sessions_in_flight", "gpu_blocks_used", "cpu_blocks_used", "requests_running",
               "requests_waiting")
"""The quantities whose halves decide :func:`steady_state`'s flag."""
_INFO_KEYS = ("requests_in_flight", "gpu_cache_usage")


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _batch_noise(samples: list[dict[str, float]], key: str, lo: float, hi: float,
                 batches: int = 8) -> float | None:
    """Two standard errors of the difference between the two halves' means, from the
    scatter of ``batches`` equal-time batch means around a straight line (a trend is not
    noise); None when a batch has no sample."""
    width = (hi - lo) / batches
    means: list[float] = []
    for i in range(batches):
        xs = [s[key] for s in samples
              if lo + i * width <= s["t"] < lo + (i + 1) * width and s.get(key) is not None]
        if not xs:
            return None
        means.append(sum(xs) / len(xs))
    xbar, ybar = (batches - 1) / 2.0, sum(means) / batches
    sxx = sum((i - xbar) ** 2 for i in range(batches))
    slope = sum((i - xbar) * (m - ybar) for i, m in enumerate(means)) / sxx
    resid = [m - (ybar + slope * (i - xbar)) for i, m in enumerate(means)]
    s_res = math.sqrt(sum(r * r for r in resid) / (batches - 2))
    half = batches // 2
    return 2.0 * s_res * math.sqrt(2.0 / half)


def steady_state(result: LoadResult, warmup_s: float, rel_tol: float = 0.10
                 ) -> dict[str, Any]:
    """Is the window ``[warmup_s, duration_s)`` at steady state? See the module doc.

    Returns ``steady`` (True, False, or None when a half has no samples or no quantity was
    sampled): every quantity of :data:`STEADY_KEYS` within ``rel_tol`` between halves (plus a
    floor: one unit, 1% of a tier's blocks); ``unsteady``: those that were not; ``halves``:
    per quantity its mean in the first and the second half (also requests in flight, the
    sessions that arrived per second and the throughput of the requests sent in each half);
    ``noise``: per quantity, two standard errors of the halves' difference estimated from the
    window's own scatter (8 batch means around a fitted line); ``steady_within_noise``: every
    quantity within ``rel_tol`` *or* within that noise (``unsteady_within_noise``: those that
    were not). With a few sessions a second the number in flight is Poisson-like (an M/G/inf
    population): a few minutes of window hold a ~10-20% difference between halves from the
    arrivals alone, so the strict flag can be False at a steady state; the noise-aware one
    still catches a queue that keeps growing, a tier still filling or a population still
    ramping up, but not a burst of arrivals in one half (``sessions_arrived_per_s`` shows
    those)."""
    lo, hi = warmup_s, result.duration_s
    mid = (lo + hi) / 2.0
    first = [s for s in result.samples if lo <= s["t"] < mid]
    second = [s for s in result.samples if mid <= s["t"] < hi]
    halves: dict[str, list[float | None]] = {}
    noise: dict[str, float | None] = {}
    unsteady: list[str] = []
    unsteady_noise: list[str] = []
    checked = 0
    for key in STEADY_KEYS + _INFO_KEYS:
        a = _mean([s[key] for s in first if s.get(key) is not None])
        b = _mean([s[key] for s in second if s.get(key) is not None])
        if a is None and b is None:
            continue
        halves[key] = [None if a is None else round(a, 3), None if b is None else round(b, 3)]
        if key not in STEADY_KEYS or a is None or b is None:
            continue
        checked += 1
        if key.endswith("_blocks_used"):
            totals = [s.get(key.replace("_used", "_total")) for s in first + second]
            floor = 0.01 * max([t for t in totals if t] or [100])
        else:
            floor = 1.0
        allowed = rel_tol * max(abs(a), abs(b)) + floor
        nz = _batch_noise(first + second, key, lo, hi)
        noise[key] = None if nz is None else round(nz, 3)
        if abs(b - a) > allowed:
            unsteady.append(key)
            if nz is None or abs(b - a) > nz:
                unsteady_noise.append(key)
    live = [s for s in first + second if s.get("sessions_in_flight")]
    # information only: KV blocks held (GPU + CPU tiers) per session in flight, over the window
    kv_per_session = (round(sum((s.get("gpu_blocks_used") or 0) + (s.get("cpu_blocks_used") or 0)
                                for s in live) / sum(s["sessions_in_flight"] for s in live), 2)
                      if live else None)
    span = (hi - lo) / 2.0
    if span > 0:  # information only: the offered load and what was served, per half
        cuts = ((lo, mid), (mid, hi))
        halves["sessions_arrived_per_s"] = [
            round(sum(1 for r in result.records if x <= r.sent < y and r.turn == 0) / span, 3)
            for x, y in cuts]
        halves["throughput_rps"] = [
            round(sum(1 for r in result.records if x <= r.sent < y and r.finished is not None)
                  / span, 3) for x, y in cuts]
    steady: bool | None = None
    steady_noise: bool | None = None
    if first and second and checked:
        steady = not unsteady
        steady_noise = not unsteady_noise
    return {"steady": steady, "unsteady": unsteady, "steady_within_noise": steady_noise,
            "unsteady_within_noise": unsteady_noise, "rel_tol": rel_tol, "halves": halves,
            "noise": noise, "samples": [len(first), len(second)],
            "kv_blocks_per_session": kv_per_session}


def capacity_at(points: list[dict[str, Any]], target_s: float,
                key: str = "normalized_latency_s_p90") -> float:
    """Highest throughput whose P90 normalized latency meets ``target_s``, interpolating
    linearly between the last point under the target and the first one over it, in order of
    offered load (``conv_rate``; throughput where a point has none): past saturation a
    system's throughput can fall as the load rises, and those points must not sit between
    the last two below saturation."""
    pts = sorted(points, key=lambda p: p.get("conv_rate", p["throughput_rps"]))
    best = 0.0
    for a, b in zip(pts, pts[1:] + [None]):
        if a[key] <= target_s:
            best = max(best, a["throughput_rps"])
            if b is not None and b[key] > target_s and math.isfinite(b[key]):
                frac = (target_s - a[key]) / (b[key] - a[key])
                best = max(best, a["throughput_rps"]
                           + frac * (b["throughput_rps"] - a["throughput_rps"]))
    return best
