"""A load run's numbers under the field names of vLLM's ``bench serve --save-result``.

:func:`vllm_metrics` reads the turns of a :class:`~pensieve.bench.loadgen.LoadResult` that were
sent in its measurement window (as :func:`pensieve.bench.run_metrics.summarize` does) and reports,
as vLLM does, over the requests that finished without an error:

- ``completed``, ``failed`` (errors and turns still unanswered at the end), ``duration`` (the
  window, seconds), ``total_input_tokens`` (prompt tokens the server counted, the whole
  history for a chat turn), ``total_output_tokens``;
- ``request_throughput`` (req/s), ``output_throughput`` and ``total_token_throughput``
  (tokens/s);
- ``mean_/median_/std_/p90_/p99_`` of ``ttft_ms`` (first token), ``tpot_ms`` (time per output
  token after the first: ``(e2el - ttft) / (output_tokens - 1)``, turns of more than one
  token), ``itl_ms`` (gaps between the stream's successive content chunks, when the client
  recorded them; None otherwise) and ``e2el_ms`` (end-to-end latency).

Pure Python, no torch.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from pensieve.bench.loadgen import LoadResult
from pensieve.bench.run_metrics import window

PERCENTILES = (90, 99)


def _percentile(xs: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default, as vLLM uses)."""
    s = sorted(xs)
    pos = q / 100 * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (pos - lo) * (s[hi] - s[lo])


def _stats(name: str, xs_s: Sequence[float]) -> dict[str, float | None]:
    """``mean_/median_/std_/pXX_<name>`` in milliseconds (None without samples)."""
    xs = [x * 1e3 for x in xs_s]
    out: dict[str, float | None] = {
        f"mean_{name}": statistics.fmean(xs) if xs else None,
        f"median_{name}": statistics.median(xs) if xs else None,
        f"std_{name}": statistics.pstdev(xs) if xs else None,
    }
    for q in PERCENTILES:
        out[f"p{q}_{name}"] = _percentile(xs, q) if xs else None
    return out


def vllm_metrics(result: LoadResult, warmup_s: float = 0.0,
                 chunk_times: Mapping[str, Sequence[float]] | None = None) -> dict[str, Any]:
    """vLLM ``bench serve`` fields of the turns sent in ``[warmup_s, duration_s)``.

    ``chunk_times``: per request id, the clock times of the stream's content chunks (ITL);
    without it the ITL fields are None."""
    recs = window(result, warmup_s)
    span = max(result.duration_s - warmup_s, 1e-9)
    done = [r for r in recs if r.finished is not None and not r.error]
    out_tokens = [r.output_tokens if r.output_tokens is not None else r.output_len for r in done]
    ttft = [r.ttft for r in done if r.ttft is not None]
    e2el = [r.latency for r in done if r.latency is not None]
    tpot = [(r.latency - r.ttft) / (n - 1) for r, n in zip(done, out_tokens, strict=True)
            if n > 1 and r.latency is not None and r.ttft is not None]
    itl: list[float] | None = None
    if chunk_times is not None:
        itl = []
        for r in done:
            times = chunk_times.get(r.request_id, ())
            itl.extend(b - a for a, b in zip(times, times[1:], strict=False))
    total_in = sum(r.context_len for r in done)
    total_out = sum(out_tokens)
    out: dict[str, Any] = {
        "duration": span,
        "completed": len(done),
        "failed": len(recs) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / span,
        "output_throughput": total_out / span,
        "total_token_throughput": (total_in + total_out) / span,
    }
    out.update(_stats("ttft_ms", ttft))
    out.update(_stats("tpot_ms", tpot))
    if itl is None:
        out.update(dict.fromkeys(_stats("itl_ms", [])))
    else:
        out.update(_stats("itl_ms", itl))
    out.update(_stats("e2el_ms", e2el))
    return out
