"""Recompute cost of one KV chunk as a function of its context length (the eviction policy's Cost).

Pensieve ranks cached chunks by a retention value ``V = Cost(l) / T``: ``T`` is how long the
conversation has been idle, ``Cost(l)`` the time to recompute one chunk of ``chunk_size`` tokens
whose context (the tokens before it) is ``l`` long. Following the paper,
``Cost(l) = Cost_attention(l) + c``: attention grows with ``l``, the rest of the layer stack
(projections, MLP, norms) is a constant ``c``.

:class:`CostModel` holds ``Cost_attention`` sampled at a few context lengths (measured offline
by :func:`pensieve.runner.profiler.profile_cost`, or estimated by :meth:`CostModel.analytic`)
and interpolates it piecewise-linearly, extrapolating linearly beyond both ends from the two
nearest points and clamping at zero. Profiles are stored as JSON, one file per model shape and
device, named by :func:`profile_key` (``profiles/<profile_key>.json``).

Pure Python (stdlib only): the scheduler evaluates it on the host for every chunk it ranks.
"""

from __future__ import annotations

import math
import os
import re
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pensieve.core.jsonio import read_json_object, write_json_atomic

FORMAT = "pensieve-cost-model"
"""Value of the ``format`` key of a saved profile."""
FORMAT_VERSION = 1
DEFAULT_CONTEXT_LENS: tuple[int, ...] = (0, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536,
                                         131072)
"""Context lengths profiled (and tabulated by :meth:`CostModel.analytic`) by default."""
H200_BF16_FLOPS = 800e12
"""Dense bf16 matmul rate used by the analytic default (measured on the H200 here)."""
H200_HBM_BYTES_PER_S = 4.3e12
"""HBM bandwidth used by the analytic default."""


@dataclass(frozen=True)
class CostModel:
    """Time (seconds) to recompute one chunk, all layers, as a function of its context length.

    ``chunk_cost(l) = attention(l) + other_s`` where ``attention`` interpolates
    ``attention_s`` over ``context_lens``. Sequences passed in are stored as tuples.
    """

    chunk_size: int
    """Tokens per chunk (the query length each sample was taken with)."""
    context_lens: tuple[int, ...]
    """Context lengths of the samples, strictly increasing, >= 0."""
    attention_s: tuple[float, ...]
    """Attention part of recomputing one chunk at each context length (all layers), >= 0."""
    other_s: float
    """The context-independent part of recomputing one chunk (all layers), >= 0."""
    model_key: str = ""
    """Which model shape this describes (see :func:`profile_key`); metadata only."""
    device: str = ""
    """Device the profile was measured on (``"analytic"`` for the roofline estimate)."""
    dtype: str = ""
    """Activation / KV dtype of the measurement (e.g. ``"bfloat16"``); metadata only."""
    source: str = "profile"
    """``"profile"`` (measured) or ``"analytic"`` (roofline estimate)."""
    measured_s: tuple[float, ...] = ()
    """Raw measured time per chunk at each context length (empty for analytic models); the
    profiler's ``attention_s`` and ``other_s`` are derived from it. Metadata only."""

    def __post_init__(self) -> None:
        # Normalise sequences (lists from JSON or callers) to tuples of plain numbers.
        object.__setattr__(self, "context_lens", tuple(self.context_lens))
        object.__setattr__(self, "attention_s", tuple(float(x) for x in self.attention_s))
        object.__setattr__(self, "measured_s", tuple(float(x) for x in self.measured_s))
        object.__setattr__(self, "other_s", float(self.other_s))
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int):
            raise ValueError(f"chunk_size must be an int, got {self.chunk_size!r}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if not self.context_lens:
            raise ValueError("a cost model needs at least one context length (got none)")
        if len(self.attention_s) != len(self.context_lens):
            raise ValueError(
                f"attention_s has {len(self.attention_s)} values for "
                f"{len(self.context_lens)} context lengths"
            )
        if self.measured_s and len(self.measured_s) != len(self.context_lens):
            raise ValueError(
                f"measured_s has {len(self.measured_s)} values for "
                f"{len(self.context_lens)} context lengths"
            )
        for x in self.context_lens:
            if isinstance(x, bool) or not isinstance(x, int):
                raise ValueError(f"context lengths must be ints, got {x!r}")
            if x < 0:
                raise ValueError(f"context lengths must be >= 0, got {x}")
        for a, b in zip(self.context_lens, self.context_lens[1:], strict=False):
            if b <= a:
                raise ValueError(
                    f"context_lens must be strictly increasing, got {list(self.context_lens)}"
                )
        for name, values in (
            ("attention_s", self.attention_s),
            ("measured_s", self.measured_s),
            ("other_s", (self.other_s,)),
        ):
            for t in values:
                if not math.isfinite(t):
                    raise ValueError(f"{name} must be finite, got {t}")
                if t < 0:
                    raise ValueError(f"{name} must be >= 0 (a time), got {t}")
        if self.source not in ("profile", "analytic"):
            raise ValueError(f"source must be 'profile' or 'analytic', got {self.source!r}")

    # ----------------------------------------------------------------------------- evaluation

    def attention_cost(self, context_len: float) -> float:
        """Attention part at ``context_len``: piecewise-linear through the samples, linear
        beyond both ends (slope of the two nearest samples), clamped at 0. Exact at the
        samples; a single sample gives a constant."""
        if context_len < 0:
            raise ValueError(f"context_len must be >= 0, got {context_len}")
        xs, ys = self.context_lens, self.attention_s
        if len(xs) == 1:
            return ys[0]
        # Segment i spans xs[i]..xs[i+1]; the end segments also serve extrapolation.
        i = min(max(bisect_right(xs, context_len) - 1, 0), len(xs) - 2)
        x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
        t = (context_len - x0) / (x1 - x0)
        # (1 - t) * y0 + t * y1 is exact at both ends of the segment (t = 0 and t = 1).
        return max(0.0, (1.0 - t) * y0 + t * y1)

    def chunk_cost(self, context_len: float) -> float:
        """Seconds to recompute one chunk of ``chunk_size`` tokens after ``context_len`` tokens:
        ``attention_cost(context_len) + other_s``."""
        return self.attention_cost(context_len) + self.other_s

    # ---------------------------------------------------------------------------- analytic

    @classmethod
    def analytic(
        cls,
        num_layers: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        intermediate_size: int,
        chunk_size: int = 32,
        flops_per_s: float = H200_BF16_FLOPS,
        bytes_per_s: float = H200_HBM_BYTES_PER_S,
        dtype_bytes: int = 2,
        *,
        gated_mlp: bool = True,
        context_lens: Sequence[int] = DEFAULT_CONTEXT_LENS,
        model_key: str = "",
    ) -> CostModel:
        """Roofline estimate, for when no profile exists.

        Per layer, for one chunk of ``C = chunk_size`` query tokens after ``l`` context tokens:

        * attention: ``max(flops / flops_per_s, bytes / bytes_per_s)`` with
          ``flops = 4 * num_heads * head_dim * (C*l + C*(C+1)/2)`` (QK^T and PV over the causal
          key range of each query) and ``bytes = 2 * (l + C) * num_kv_heads * head_dim *
          dtype_bytes`` (reading K and V of the whole context, the chunk's own included);
        * everything else: FLOPs only, ``2 * C * (weights of qkv, o, MLP)``. A chunk recomputed
          inside a batch shares the weight reads with the rest of the batch, so they are not
          charged to it. ``gated_mlp``: three MLP matrices (Llama) instead of two (OPT).

        Attention is tabulated at ``context_lens`` (max of two lines in ``l``: linear beyond the
        last sample, so extrapolation stays exact).
        """
        ints = {
            "num_layers": num_layers, "hidden_size": hidden_size, "num_heads": num_heads,
            "num_kv_heads": num_kv_heads, "head_dim": head_dim,
            "intermediate_size": intermediate_size, "chunk_size": chunk_size,
            "dtype_bytes": dtype_bytes,
        }
        for name, v in ints.items():
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if not (flops_per_s > 0 and bytes_per_s > 0):
            raise ValueError(f"rates must be positive, got {flops_per_s=} {bytes_per_s=}")
        c = chunk_size
        lens = tuple(int(x) for x in context_lens)
        attention: list[float] = []
        for ctx in lens:
            pairs = c * ctx + c * (c + 1) / 2
            flops = 4.0 * num_heads * head_dim * pairs
            nbytes = 2.0 * (ctx + c) * num_kv_heads * head_dim * dtype_bytes
            attention.append(num_layers * max(flops / flops_per_s, nbytes / bytes_per_s))
        q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
        weights = (
            hidden_size * (q_width + 2 * kv_width)  # qkv projection
            + q_width * hidden_size  # output projection
            + (3 if gated_mlp else 2) * hidden_size * intermediate_size  # MLP
        )
        other = num_layers * 2.0 * c * weights / flops_per_s
        return cls(
            chunk_size=c, context_lens=lens, attention_s=tuple(attention), other_s=other,
            model_key=model_key, device="analytic", source="analytic",
        )

    # ---------------------------------------------------------------------------- storage

    def to_dict(self) -> dict[str, object]:
        """JSON-ready dict (see :meth:`from_dict`)."""
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "model_key": self.model_key,
            "device": self.device,
            "dtype": self.dtype,
            "source": self.source,
            "chunk_size": self.chunk_size,
            "context_lens": list(self.context_lens),
            "attention_s": list(self.attention_s),
            "other_s": self.other_s,
            "measured_s": list(self.measured_s),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> CostModel:
        """Inverse of :meth:`to_dict`; raises ValueError on a malformed dict."""
        fmt = d.get("format", FORMAT)
        if fmt != FORMAT:
            raise ValueError(f"not a cost model (format {fmt!r}, expected {FORMAT!r})")
        version = d.get("version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise ValueError(f"unsupported cost model version {version!r} (know {FORMAT_VERSION})")
        for key in ("chunk_size", "context_lens", "attention_s", "other_s"):
            if key not in d:
                raise ValueError(f"cost model dict lacks {key!r}")
        return cls(
            chunk_size=_as_int(d["chunk_size"], "chunk_size"),
            context_lens=tuple(_as_int(x, "context_lens") for x in _as_list(d, "context_lens")),
            attention_s=tuple(_as_float(x, "attention_s") for x in _as_list(d, "attention_s")),
            other_s=_as_float(d["other_s"], "other_s"),
            model_key=_as_str(d, "model_key", ""),
            device=_as_str(d, "device", ""),
            dtype=_as_str(d, "dtype", ""),
            source=_as_str(d, "source", "profile"),
            measured_s=tuple(_as_float(x, "measured_s") for x in _as_list(d, "measured_s")),
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write as JSON (creating the parent directory; atomic replace)."""
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CostModel:
        """Read a file written by :meth:`save`; raises ValueError if it is not one."""
        return cls.from_dict(read_json_object(path))


def _sanitize(s: str) -> str:
    """Keep ``[A-Za-z0-9.+-]``; any other run of characters becomes one ``_``."""
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", s).strip("_") or "unknown"


def profile_key(
    model_type: str,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    device_name: str,
) -> str:
    """Stable profile name for a model shape on a device, e.g.
    ``llama-L40-H5120-q40-kv10-d128-i13824__NVIDIA_H200``; the file is ``<key>.json``.

    Depends on the shape only (not the weights), so dummy-weight profiles serve real
    checkpoints of the same shape.
    """
    shape = (
        f"{_sanitize(model_type)}-L{num_layers}-H{hidden_size}-q{num_heads}-kv{num_kv_heads}"
        f"-d{head_dim}-i{intermediate_size}"
    )
    return f"{shape}__{_sanitize(device_name)}"


def _as_list(d: Mapping[str, object], key: str) -> list[object]:
    v = d.get(key, [])
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"{key} must be a list, got {type(v).__name__}")
    return list(v)


def _as_int(v: object, key: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{key}: expected an int, got {v!r}")
    return v


def _as_float(v: object, key: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{key}: expected a number, got {v!r}")
    return float(v)


def _as_str(d: Mapping[str, object], key: str, default: str) -> str:
    v = d.get(key, default)
    if not isinstance(v, str):
        raise ValueError(f"{key}: expected a string, got {v!r}")
    return v


__all__ = ["CostModel", "DEFAULT_CONTEXT_LENS", "profile_key"]
