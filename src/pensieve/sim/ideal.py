"""The ideal bound: what a serving system could carry on measured hardware rates.

An ideal system computes only each turn's new tokens (no recomputation, no wait for a copy,
no host time), runs each prefill at the best measured rate for its context and each decode
at the HBM floor. In the simulator it is the engine's scheduler over a GPU tier too large to
ever evict a live conversation (so nothing is dropped, swapped or recomputed), whose steps
take :class:`IdealStepTime` of their :class:`~pensieve.core.outputs.SchedulerOutput`
(``SimEngine(step_time=...)``) instead of a fitted step-cost model. Queueing is left in: the
arrivals, the token budget per step and chunked prefill are the scheduler's.

One step of the ideal, for the query ranges ``(start, q)`` it computes::

    compute = W / HBM + a * sum(q over prefill ranges)
              + sum(b * best(start) * q * (start + (q + 1) / 2) over prefill ranges)
    floor   = (W + kv_bytes * sum(end over all ranges)) / HBM          (the HBM floor)
    step    = max(compute, floor)          (a decode-only step: the floor alone)

``W``: the weights' bytes; ``a``, ``b``: the per-token and per query-key-pair seconds of a
forward pass with Pensieve's attention kernel, fitted on measured prefill steps
(:func:`fit_forward`); ``best(context)``: min(1, SDPA's attention time / ours) at that context
(:func:`attention_ratios`, from ``benchmarks/long_attention.py``): the faster of the two
kernels. Decodes riding with a prefill are hidden under it (the bound is optimistic).

Pure Python: no torch, no numpy.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pensieve.core.outputs import SchedulerOutput


@dataclass(frozen=True)
class ForwardRates:
    """Measured rates of one model shape on one device (all layers)."""

    weights_bytes: float
    """Bytes of the weights: each step reads them once."""
    kv_bytes_per_token: float
    """K+V bytes of one token over all layers, in the KV dtype of the system bounded."""
    hbm_bytes_per_s: float
    """Measured HBM rate (device copy, docs/performance.md's ceiling)."""
    per_prefill_token_s: float
    """``a``: seconds per prefill token outside attention (fitted on measured steps)."""
    per_attn_pair_s: float
    """``b``: seconds per causal query-key pair with Pensieve's kernel (fitted likewise)."""
    attn_contexts: tuple[int, ...] = ()
    """Contexts at which the kernels were compared (increasing)."""
    attn_best: tuple[float, ...] = ()
    """At each of ``attn_contexts``: min(1, SDPA / ours), the factor on ``b`` for the faster
    kernel; held flat outside the measured contexts (1.0 with none)."""
    source: str = ""

    def best(self, context: int) -> float:
        """The factor on ``per_attn_pair_s`` for the faster kernel at ``context``."""
        xs, ys = self.attn_contexts, self.attn_best
        if not xs:
            return 1.0
        if context <= xs[0]:
            return ys[0]
        if context >= xs[-1]:
            return ys[-1]
        i = bisect_left(xs, context)
        t = (context - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + t * (ys[i] - ys[i - 1])

    def prefill_s(self, start: int, q: int) -> float:
        """Seconds of a ``q``-token prefill range at ``start`` (without the weights' read)."""
        pairs = q * (start + (q + 1) / 2)
        return self.per_prefill_token_s * q + self.per_attn_pair_s * self.best(start + q) * pairs


class IdealStepTime:
    """Seconds of one step at the ideal (module docstring); a ``SimEngine(step_time=...)``."""

    def __init__(self, rates: ForwardRates) -> None:
        self.rates = rates
        self.weights_s = rates.weights_bytes / rates.hbm_bytes_per_s

    def __call__(self, sched: SchedulerOutput) -> float:
        r = self.rates
        prefill = 0.0
        has_prefill = False
        kv_tokens = 0
        for s in sched.requests:
            for rng in s.ranges:
                q = rng.query_len
                if q > 1:
                    has_prefill = True
                    prefill += r.prefill_s(rng.start_pos, q)
                kv_tokens += rng.start_pos + q
        floor = self.weights_s + kv_tokens * r.kv_bytes_per_token / r.hbm_bytes_per_s
        return max(self.weights_s + prefill, floor) if has_prefill else floor


def fit_forward(steps: Iterable[Mapping[str, float]], weights_s: float) -> tuple[float, float]:
    """``(a, b)`` of ``time = weights_s + a * tokens + b * pairs``, least squares over measured
    steps, each a mapping with ``time_s``, ``tokens`` (query tokens computed) and ``pairs``
    (causal query-key pairs). Raises ValueError with fewer than two independent steps."""
    sxx = sxy = syy = sx = sy = 0.0
    rows = [(float(s["tokens"]), float(s["pairs"]), float(s["time_s"]) - weights_s)
            for s in steps]
    for x, y, t in rows:
        sxx += x * x
        sxy += x * y
        syy += y * y
        sx += x * t
        sy += y * t
    det = sxx * syy - sxy * sxy
    if len(rows) < 2 or det <= 1e-12 * sxx * syy:
        raise ValueError("fit_forward needs at least two independent steps")
    return (sx * syy - sy * sxy) / det, (sy * sxx - sx * sxy) / det


def prefill_stall_steps(doc: Mapping[str, Any]) -> list[dict[str, float]]:
    """The prefill steps of ``benchmarks/prefill_stall.py``'s JSON as :func:`fit_forward`
    rows: one prompt's chunks back to back from position 0, each step with the run's
    ``decodes`` one-token decodes at ``decode_context`` riding along."""
    cfg = doc["config"]
    n_dec, dec_ctx = int(cfg["decodes"]), int(cfg["decode_context"])
    pos, out = 0, []
    for st in doc["steps"]:
        q = int(st["prompt_tokens"])
        out.append({"time_s": float(st["time_s"]), "tokens": q + n_dec,
                    "pairs": q * (pos + (q + 1) / 2) + n_dec * (dec_ctx + 1)})
        pos += q
    return out


def attention_ratios(rows: Sequence[Mapping[str, Any]], kv: str = "bf16"
                     ) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """``(contexts, min(1, sdpa / ours))`` from ``benchmarks/long_attention.py`` rows of its
    prefill case (``query_len > 1``), graph replays where timed, for our kernel over ``kv``."""
    pts = []
    for r in rows:
        if r.get("query_len", 1) <= 1:
            continue
        g = "_graph" if r.get(f"ours_{kv}_graph_s") and r.get("sdpa_graph_s") else ""
        pts.append((int(r["context"]), min(1.0, r[f"sdpa{g}_s"] / r[f"ours_{kv}{g}_s"])))
    pts.sort()
    return tuple(c for c, _ in pts), tuple(x for _, x in pts)


def attention_factor(rows: Sequence[Mapping[str, Any]], num: str, den: str = "bf16"
                     ) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """``(contexts, ours over num / ours over den)`` of the prefill rows (graph replays where
    timed): how much slower a kernel path is than another at each context (FP8 over bf16)."""
    pts = []
    for r in rows:
        if r.get("query_len", 1) <= 1:
            continue
        g = "_graph" if r.get(f"ours_{num}_graph_s") and r.get(f"ours_{den}_graph_s") else ""
        pts.append((int(r["context"]), r[f"ours_{num}{g}_s"] / r[f"ours_{den}{g}_s"]))
    pts.sort()
    return tuple(c for c, _ in pts), tuple(x for _, x in pts)


__all__ = ["ForwardRates", "IdealStepTime", "attention_factor", "attention_ratios",
           "fit_forward", "prefill_stall_steps"]
