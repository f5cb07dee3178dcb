"""Time of one engine step as a function of what the scheduler put in it.

The simulator (:mod:`pensieve.sim.simulator`) runs the real scheduler and cache and advances a
virtual clock by :meth:`StepCostModel.predict` of each :class:`~pensieve.core.outputs.
SchedulerOutput`. The model is calibrated by :meth:`StepCostModel.fit` on ``(features, measured
step time)`` records taken from the real engine on the real device (``RunnerOutput.step_time_s``
with ``features_of`` of the same step); :meth:`StepCostModel.analytic` is a roofline *prior* from
hardware rates, for when no calibration exists, and is labelled ``source="analytic"``.

The formula (all times in seconds)::

    compute = base_s
            + per_prefill_step_s  * (num_prefill_tokens > 0)
            + per_request_s       * num_requests
            + per_prefill_token_s * num_prefill_tokens
            + per_decode_token_s  * num_decode_tokens
            + per_attn_pair_s     * attn_pairs
            + per_kv_read_token_s * kv_read_tokens
    urgent  = swap_copy_chunk_s * urgent_swap_out_chunks          # before compute, exposed
    overlap = swap_copy_chunk_s * (swap_in_chunks + swap_out_chunks - urgent_swap_out_chunks)
    step    = compute + urgent + max(0, overlap - compute)
            + per_swap_chunk_s  * (swap_in_chunks + swap_out_chunks)

This mirrors the runner: urgent swap-outs (``SwapPlan.swap_out_first``) finish before the step
touches any KV; swap-ins (layer by layer) and ahead-of-time swap-outs run on one copy stream
beside the compute, and every copy is done when the step returns, so only the part of the copy
time that the compute does not cover is exposed. Two swap coefficients, with distinct roles:

* ``swap_copy_chunk_s`` is *physical*: the PCIe time of one chunk (all layers, K and V), i.e.
  ``chunk_bytes / bandwidth``. It is not fitted; it is given (from the hardware rate or from
  ``benchmarks/swap_bandwidth.py``) and enters through the max above. 0 turns the term off.
* ``per_swap_chunk_s`` is a *fitted* linear coefficient: exposed time per chunk copied on top of
  that (issue cost, gather/scatter kernels, synchronisation). With ``swap_copy_chunk_s = 0`` it
  is the whole swap model: a plain linear fit of the average exposed time per chunk.

With ``swap_copy_chunk_s = 0`` the model is linear in its coefficients and :meth:`fit` is one
non-negative least-squares solve; otherwise :meth:`fit` alternates (subtract the exposed copy
time predicted by the current coefficients, refit) until the coefficients settle.

Those two swap terms describe the runner the step records were measured on (one copy stream,
every copy done when the step returns). The copies of the swap kernel are modelled apart, as
measured rather than fitted: :class:`TransferModel` (rates in GB/s each way, e.g. from
``benchmarks/swap_bandwidth.py``'s JSON) and :class:`TransferTimeline` (background swap-outs
that outlive their step) give each simulated step its exposed copy time, carried in
``StepFeatures.exposed_copy_s``; :meth:`StepCostModel.predict` then adds that to the fitted
compute instead of its own swap terms. Step-cost JSON files of version 1 load unchanged.

Pure Python plus numpy (only :meth:`StepCostModel.fit` needs numpy; scipy's NNLS is used when
installed, else an active-set NNLS on numpy). No torch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from pensieve.core.copy_order import copy_waits
from pensieve.core.cost_model import H200_BF16_FLOPS, H200_HBM_BYTES_PER_S
from pensieve.core.jsonio import read_json_object, write_json_atomic
from pensieve.core.outputs import SchedulerOutput
from pensieve.sim.transfer_model import (
    DEFAULT_SWAP_GBPS,
    PREFERRED_CASES,
    StepTransfer,
    TransferModel,
    TransferTimeline,
)

FORMAT = "pensieve-step-cost"
FORMAT_VERSION = 1
H200_PCIE_BYTES_PER_S = 55e9
"""Host<->device copy rate, one direction, large pinned copies on the H200 (docs/performance.md,
"Swaps between the GPU and CPU tiers": the raw single copies)."""


# --------------------------------------------------------------------------------- features
@dataclass(frozen=True)
class StepFeatures:
    """What one step computes and copies, counted from its :class:`SchedulerOutput`."""

    num_prefill_tokens: int = 0
    """Query tokens of ranges with ``query_len > 1`` (new prompts, recomputed chunks)."""
    num_decode_tokens: int = 0
    """Query tokens of ranges with ``query_len == 1``."""
    num_requests: int = 0
    """Requests in the batch."""
    attn_pairs: float = 0.0
    """Query-key pairs under the causal mask: ``sum q * (start_pos + (q + 1) / 2)`` over ranges
    (query ``i`` of a range at ``start_pos`` attends to ``start_pos + i + 1`` keys)."""
    kv_read_tokens: int = 0
    """Context tokens whose K/V the attention reads: ``sum end_pos`` over ranges."""
    swap_in_chunks: int = 0
    """``len(SwapPlan.swap_in)``."""
    swap_out_chunks: int = 0
    """``len(SwapPlan.swap_out_first) + len(SwapPlan.swap_out)``."""
    urgent_swap_out_chunks: int = 0
    """``len(SwapPlan.swap_out_first)`` (included in ``swap_out_chunks``): copied before the
    step's compute, so never hidden behind it."""
    exposed_copy_s: float | None = None
    """Copy time the step waited for beyond its compute, when known: the simulator's
    :class:`TransferModel` sets it (then :meth:`StepCostModel.predict` adds it instead of the
    model's own copy terms, and :meth:`StepCostModel.fit` subtracts it); None when not known
    (:func:`features_of`, records measured on the real engine)."""

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def swap_chunks(self) -> int:
        return self.swap_in_chunks + self.swap_out_chunks

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StepFeatures:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown step feature(s) {sorted(unknown)}")
        vals: dict[str, Any] = {
            k: (None if v is None else float(v)) if k == "exposed_copy_s"
            else float(v) if k == "attn_pairs" else int(v)
            for k, v in d.items()}
        return cls(**vals)


def features_of(sched: SchedulerOutput,
                loaded: Mapping[str, tuple[int, int]] | None = None) -> StepFeatures:
    """Count the features of one step (pure Python; no tensors). ``loaded``: request id ->
    positions ``[lo, hi)`` of its context whose KV is read from elsewhere (a shared tier)
    rather than computed; the step computes only the rest of its ranges::

        range      [start_pos ........................ end_pos)
        loaded          [lo ........ hi)
        computed   [....)               [.............)      (each part counted as a range)
    """
    prefill = decode = kv_read = 0
    pairs = 0.0
    for s in sched.requests:
        span = loaded.get(s.request_id) if loaded else None
        for start, q in _computed(s.ranges, span):
            end = start + q
            if q > 1:
                prefill += q
            elif q == 1:
                decode += 1
            pairs += q * (start + (q + 1) / 2)
            kv_read += end
    sw = sched.swaps
    return StepFeatures(
        num_prefill_tokens=prefill,
        num_decode_tokens=decode,
        num_requests=len(sched.requests),
        attn_pairs=pairs,
        kv_read_tokens=kv_read,
        swap_in_chunks=len(sw.swap_in),
        swap_out_chunks=len(sw.swap_out_first) + len(sw.swap_out),
        urgent_swap_out_chunks=len(sw.swap_out_first),
    )


def _computed(ranges: Sequence[Any], span: tuple[int, int] | None
              ) -> list[tuple[int, int]]:
    """``(start_pos, query_len)`` of the parts of ``ranges`` outside ``span`` (all of them
    when ``span`` is None)."""
    if span is None:
        return [(r.start_pos, r.query_len) for r in ranges]
    lo, hi = span
    out = []
    for r in ranges:
        a, b = r.start_pos, r.end_pos
        for x, y in ((a, min(b, lo)), (max(a, hi), b)):
            if y > x:
                out.append((x, y - x))
    return out


# --------------------------------------------------------------------------------- the model
COEFFICIENTS: tuple[str, ...] = (
    "base_s",
    "per_prefill_step_s",
    "per_request_s",
    "per_prefill_token_s",
    "per_decode_token_s",
    "per_attn_pair_s",
    "per_kv_read_token_s",
    "per_swap_chunk_s",
)
"""The linear coefficients, in the order of :func:`_design_row`."""


def _design_row(f: StepFeatures) -> list[float]:
    return [
        1.0,
        1.0 if f.num_prefill_tokens > 0 else 0.0,
        float(f.num_requests),
        float(f.num_prefill_tokens),
        float(f.num_decode_tokens),
        float(f.attn_pairs),
        float(f.kv_read_tokens),
        float(f.swap_chunks) if f.exposed_copy_s is None else 0.0,
    ]


@dataclass(frozen=True)
class StepCostModel:
    """Seconds per step, linear in the features plus the exposed copy time (module docstring).

    Every coefficient is >= 0. ``source`` says where the numbers come from: ``"fit"``
    (calibrated on measured steps), ``"analytic"`` (roofline prior from hardware rates, not a
    measurement) or ``"manual"``. The ``fit_*`` fields describe the calibration records.
    """

    base_s: float = 0.0
    """Fixed per-step overhead (scheduling, launches; analytic: reading the weights once)."""
    per_prefill_step_s: float = 0.0
    """Extra fixed cost of a step with any multi-token range: the engine replays decode-only
    steps from CUDA graphs and runs the others eagerly, one launch per kernel from Python."""
    per_request_s: float = 0.0
    """Per request in the batch (metadata, sampling)."""
    per_prefill_token_s: float = 0.0
    """Per query token of a multi-token range (the linear layers)."""
    per_decode_token_s: float = 0.0
    """Per single-token (decode) range."""
    per_attn_pair_s: float = 0.0
    """Per causal query-key pair (attention FLOPs)."""
    per_kv_read_token_s: float = 0.0
    """Per context token read by attention (KV bytes from HBM)."""
    per_swap_chunk_s: float = 0.0
    """Fitted exposed time per chunk copied, on top of the overlap term."""
    swap_copy_chunk_s: float = 0.0
    """PCIe time of one chunk (all layers, K+V); enters as ``max(0, copies - compute)``, plus
    in full for urgent swap-outs. Given, not fitted (0: off)."""
    source: str = "manual"
    label: str = ""
    """Free text: model, device, dtype, chunk size the numbers are for."""
    fit_num_records: int = 0
    fit_median_rel_err: float | None = None
    """Median of ``|pred - measured| / measured`` on the records the model was fitted on."""
    fit_p90_rel_err: float | None = None
    """90th percentile of the same."""

    def __post_init__(self) -> None:
        for name in (*COEFFICIENTS, "swap_copy_chunk_s"):
            v = float(getattr(self, name))
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {v}")
            object.__setattr__(self, name, v)
        if self.source not in ("fit", "analytic", "manual"):
            raise ValueError(f"source must be 'fit', 'analytic' or 'manual', got {self.source!r}")

    @property
    def coefficients(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in COEFFICIENTS}

    # ------------------------------------------------------------------------- evaluation
    def compute_time(self, f: StepFeatures) -> float:
        """The compute part (everything but copies)."""
        return (
            self.base_s
            + (self.per_prefill_step_s if f.num_prefill_tokens > 0 else 0.0)
            + self.per_request_s * f.num_requests
            + self.per_prefill_token_s * f.num_prefill_tokens
            + self.per_decode_token_s * f.num_decode_tokens
            + self.per_attn_pair_s * f.attn_pairs
            + self.per_kv_read_token_s * f.kv_read_tokens
        )

    def exposed_copy_time(self, f: StepFeatures, compute: float | None = None) -> float:
        """Copy time not hidden behind ``compute``: urgent copies in full, the rest beyond it
        (``f.exposed_copy_s`` instead when the features carry it)."""
        if f.exposed_copy_s is not None:
            return f.exposed_copy_s
        if self.swap_copy_chunk_s == 0.0:
            return 0.0
        c = self.compute_time(f) if compute is None else compute
        urgent = self.swap_copy_chunk_s * f.urgent_swap_out_chunks
        overlap = self.swap_copy_chunk_s * (f.swap_chunks - f.urgent_swap_out_chunks)
        return urgent + max(0.0, overlap - c)

    def predict(self, f: StepFeatures) -> float:
        """Seconds for a step with features ``f``: compute plus exposed copy time. When ``f``
        carries ``exposed_copy_s`` (a :class:`TransferModel` computed it) that is the whole
        copy part: ``swap_copy_chunk_s`` and ``per_swap_chunk_s`` describe the copies of the
        runner the model was fitted on and are not added."""
        c = self.compute_time(f)
        if f.exposed_copy_s is not None:
            return c + f.exposed_copy_s
        return c + self.exposed_copy_time(f, c) + self.per_swap_chunk_s * f.swap_chunks

    # ---------------------------------------------------------------------------- priors
    @classmethod
    def analytic(
        cls,
        num_params: float,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        chunk_size: int = 32,
        dtype_bytes: int = 2,
        flops_per_s: float = H200_BF16_FLOPS,
        hbm_bytes_per_s: float = H200_HBM_BYTES_PER_S,
        pcie_bytes_per_s: float = H200_PCIE_BYTES_PER_S,
        label: str = "",
    ) -> StepCostModel:
        """Roofline **prior** from hardware rates; a stand-in until :meth:`fit` has measured
        steps, not a calibration (``source="analytic"``). The caller gives the model's shape
        (e.g. Llama 2-13B: ``num_params`` ~13.0e9, 40 layers, 40 heads, head_dim 128, and the
        number of KV heads of the variant); rates default to the H200 figures of this repo.

        * ``base_s = num_params * dtype_bytes / hbm``: every step reads all weights once (the
          decode floor);
        * ``per_prefill_token_s = per_decode_token_s = 2 * num_params / flops``: matmul FLOPs
          of one token (summing this with ``base_s`` bounds the roofline ``max`` from above);
        * ``per_attn_pair_s = 4 * num_heads * head_dim * num_layers / flops`` (QK^T and PV);
        * ``per_kv_read_token_s = 2 * num_layers * num_kv_heads * head_dim * dtype_bytes / hbm``;
        * ``swap_copy_chunk_s = chunk_size * kv_bytes_per_token / pcie`` (overlap model);
        * ``per_request_s = per_swap_chunk_s = 0``: no rate predicts them; only a fit does.
        """
        for name, v in (("num_layers", num_layers), ("num_heads", num_heads),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("chunk_size", chunk_size), ("dtype_bytes", dtype_bytes)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if not (num_params > 0 and flops_per_s > 0 and hbm_bytes_per_s > 0
                and pcie_bytes_per_s > 0):
            raise ValueError("num_params and the rates must be positive")
        kv_bytes_per_token = 2.0 * num_layers * num_kv_heads * head_dim * dtype_bytes
        per_token = 2.0 * num_params / flops_per_s
        return cls(
            base_s=num_params * dtype_bytes / hbm_bytes_per_s,
            per_request_s=0.0,
            per_prefill_token_s=per_token,
            per_decode_token_s=per_token,
            per_attn_pair_s=4.0 * num_heads * head_dim * num_layers / flops_per_s,
            per_kv_read_token_s=kv_bytes_per_token / hbm_bytes_per_s,
            per_swap_chunk_s=0.0,
            swap_copy_chunk_s=chunk_size * kv_bytes_per_token / pcie_bytes_per_s,
            source="analytic",
            label=label or (
                f"analytic prior: {num_params:.3g} params, L{num_layers} q{num_heads} "
                f"kv{num_kv_heads} d{head_dim}, chunk {chunk_size}, {dtype_bytes}-byte dtype, "
                f"{flops_per_s:.3g} FLOP/s, HBM {hbm_bytes_per_s:.3g} B/s, "
                f"PCIe {pcie_bytes_per_s:.3g} B/s"
            ),
        )

    # ---------------------------------------------------------------------------- fitting
    @classmethod
    def fit(
        cls,
        records: Sequence[tuple[StepFeatures, float]],
        *,
        swap_copy_chunk_s: float = 0.0,
        relative: bool = True,
        label: str = "",
        max_iter: int = 50,
    ) -> StepCostModel:
        """Non-negative least squares of the coefficients on ``(features, measured seconds)``.

        ``relative``: weight each record by ``1 / measured`` (minimise squared *relative*
        errors, so short decode steps count as much as long prefills). ``swap_copy_chunk_s``
        fixes the physical copy time (see the module docstring); with it > 0 the fit alternates
        between the exposed copy time and the linear solve. A record whose features carry
        ``exposed_copy_s`` (a simulated step, or a measured one whose copy wait is known) has
        that subtracted and takes no part in ``per_swap_chunk_s``, as :meth:`predict` treats
        it. Features that are zero on every record get coefficient 0. The fitted model carries
        the median and P90 relative error on ``records`` (:func:`relative_errors`).
        """
        import numpy as np

        if not records:
            raise ValueError("fit needs at least one record")
        y = np.array([float(t) for _, t in records], dtype=np.float64)
        if not np.all(np.isfinite(y)) or np.any(y <= 0):
            raise ValueError("measured step times must be finite and > 0")
        a = np.array([_design_row(f) for f, _ in records], dtype=np.float64)
        w = 1.0 / y if relative else np.ones_like(y)
        model = cls(swap_copy_chunk_s=swap_copy_chunk_s, source="fit", label=label)
        prev: np.ndarray | None = None
        for _ in range(max(1, max_iter)):
            exposed = np.array([model.exposed_copy_time(f) for f, _ in records])
            coef = nnls_scaled(a * w[:, None], (y - exposed) * w)
            coefs: dict[str, Any] = dict(zip(COEFFICIENTS, (float(c) for c in coef)))
            model = cls(**coefs, swap_copy_chunk_s=swap_copy_chunk_s, source="fit", label=label)
            if swap_copy_chunk_s == 0.0:
                break
            if prev is not None and np.allclose(coef, prev, rtol=1e-10, atol=0.0):
                break
            prev = coef
        err = relative_errors(model, records)
        return cls(**{**model._fields(), "fit_num_records": len(records),
                      "fit_median_rel_err": err["median"], "fit_p90_rel_err": err["p90"]})

    # ---------------------------------------------------------------------------- storage
    def _fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": FORMAT_VERSION, **self._fields()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StepCostModel:
        fmt = d.get("format", FORMAT)
        if fmt != FORMAT:
            raise ValueError(f"not a step cost model (format {fmt!r}, expected {FORMAT!r})")
        if d.get("version", FORMAT_VERSION) != FORMAT_VERSION:
            raise ValueError(f"unsupported step cost model version {d.get('version')!r}")
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known - {"format", "version"}
        if unknown:
            raise ValueError(f"unknown step cost model key(s) {sorted(unknown)}")
        return cls(**{k: v for k, v in d.items() if k in known})

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write as JSON (creating the parent directory; atomic replace)."""
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> StepCostModel:
        """Read a file written by :meth:`save`; raises ValueError if it is not one."""
        return cls.from_dict(read_json_object(path))


def fit(records: Sequence[tuple[StepFeatures, float]], **kw: Any) -> StepCostModel:
    """:meth:`StepCostModel.fit`."""
    return StepCostModel.fit(records, **kw)


def relative_errors(
    model: StepCostModel, records: Sequence[tuple[StepFeatures, float]]
) -> dict[str, float]:
    """``|predict - measured| / measured`` over ``records``: median, P90, max and mean."""
    errs = sorted(abs(model.predict(f) - t) / t for f, t in records if t > 0)
    if not errs:
        raise ValueError("no record with a positive measured time")
    return {"median": _quantile(errs, 0.5), "p90": _quantile(errs, 0.9),
            "max": errs[-1], "mean": sum(errs) / len(errs)}


def _quantile(sorted_xs: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    pos = q * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (pos - lo) * (sorted_xs[hi] - sorted_xs[lo])


# ---------------------------------------------------------------- the fit's solver

def nnls_scaled(a: Any, b: Any) -> Any:
    """NNLS on column-normalised ``a`` (features span ~1 to ~1e9), all-zero columns -> 0."""
    import numpy as np

    norms = np.linalg.norm(a, axis=0)
    live = norms > 0
    x = np.zeros(a.shape[1])
    if live.any():
        x[live] = nnls(a[:, live] / norms[live], b) / norms[live]
    return x


def nnls(a: Any, b: Any, max_iter: int | None = None) -> Any:
    """``argmin ||a x - b||_2`` subject to ``x >= 0``: scipy's solver when installed, else
    Lawson-Hanson active set on numpy."""
    import numpy as np

    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    try:
        from scipy.optimize import nnls as scipy_nnls
    except ImportError:
        return _nnls_active_set(a, b, max_iter)
    return scipy_nnls(a, b)[0]


def _nnls_active_set(a: Any, b: Any, max_iter: int | None = None) -> Any:
    """Lawson & Hanson (1974), Algorithm NNLS."""
    import numpy as np

    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(np.float64).eps * np.linalg.norm(a, 1) * max(m, n)
    max_iter = 3 * n if max_iter is None else max_iter
    w = a.T @ (b - a @ x)
    it = 0
    while (~passive).any() and (w[~passive] > tol).any():
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            it += 1
            if it > max_iter * 10:
                return x
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            bad = passive & (z <= 0)
            denom = x[bad] - z[bad]
            ratio = np.divide(x[bad], denom, out=np.zeros_like(denom), where=denom > 0)
            alpha = float(np.min(ratio))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        w = a.T @ (b - a @ x)
    return x


__all__ = [
    "COEFFICIENTS",
    "DEFAULT_SWAP_GBPS",
    "H200_PCIE_BYTES_PER_S",
    "PREFERRED_CASES",
    "StepCostModel",
    "StepFeatures",
    "StepTransfer",
    "TransferModel",
    "TransferTimeline",
    "copy_waits",
    "features_of",
    "fit",
    "nnls",
    "relative_errors",
]
