"""Triton kernels of the decoder's small element-wise ops, fused: residual add + RMSNorm,
rotary embedding (in place), SiLU-and-multiply.

Raw ``@triton.jit`` kernels only; :mod:`pensieve.kernels.launch_fused` validates and launches
them, :mod:`pensieve.kernels.reference` holds the pure-torch semantics. Eager torch spends 8
kernels on an RMSNorm, 10 on the rotary of q and k and 2 on SiLU-and-multiply, each a
launch and a round trip through HBM; at decode these small kernels, not their bytes, cost
the time (docs/performance.md). Every kernel rounds to the storage dtype exactly where the
torch reference does (``ROUND`` below), so bf16 results match the reference up to the order
of the RMSNorm's sum.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """Round float32 ``x`` to the storage dtype and back: the rounding of one torch op."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_res,
    stride_out,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row. With a residual: ``s = x + res`` (rounded), ``res <- s``; then
    ``out = w * (s * rsqrt(mean(s**2) + eps))`` with the normalised value rounded before the
    scale, as HF's LlamaRMSNorm does."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        x = _round(x + r, dtype)
        tl.store(res_ptr + row * stride_res + cols, x.to(dtype), mask=mask)
    var = tl.sum(x * x, axis=0) / n_cols
    y = _round(x * tl.math.rsqrt(var + eps), dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * y).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_cos,
    stride_sin,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """One program per token, in place over its q and k heads: the first ``2 * HALF``
    channels ``[x1, x2]`` become ``[x1 * c - x2 * s, x2 * c + x1 * s]`` (HF's
    ``x * cos + rotate_half(x) * sin`` with ``cos = cat(c, c)``), each product and the sum
    rounded as torch rounds them; channels past ``2 * HALF`` are left as they are."""
    tok = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF)
    dtype = q_ptr.dtype.element_ty
    c1 = tl.load(cos_ptr + tok * stride_cos + d).to(tl.float32)
    c2 = tl.load(cos_ptr + tok * stride_cos + HALF + d).to(tl.float32)
    s1 = tl.load(sin_ptr + tok * stride_sin + d).to(tl.float32)
    s2 = tl.load(sin_ptr + tok * stride_sin + HALF + d).to(tl.float32)
    h = tl.arange(0, BLOCK_H).to(tl.int64)
    for which in tl.static_range(2):
        if which == 0:
            base = q_ptr + tok * stride_q_t + h[:, None] * stride_q_h
            mask = (h < num_q_heads)[:, None]
        else:
            base = k_ptr + tok * stride_k_t + h[:, None] * stride_k_h
            mask = (h < num_k_heads)[:, None]
        x1 = tl.load(base + d[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + d[None, :], mask=mask, other=0.0).to(tl.float32)
        o1 = _round(x1 * c1[None, :], dtype) + _round(-x2 * s1[None, :], dtype)
        o2 = _round(x2 * c2[None, :], dtype) + _round(x1 * s2[None, :], dtype)
        tl.store(base + d[None, :], o1.to(dtype), mask=mask)
        tl.store(base + HALF + d[None, :], o2.to(dtype), mask=mask)


@triton.jit
def _silu_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_out,
    n_cols,
    BLOCK: tl.constexpr,
):
    """Grid ``(rows, cdiv(n_cols, BLOCK))``: ``out = silu(gate) * up`` for ``x = [gate | up]``,
    the SiLU rounded before the product as torch's two ops round."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = _round(g / (1.0 + tl.exp(-g)), dtype)
    tl.store(out_ptr + row * stride_out + cols, (act * u).to(dtype), mask=mask)
