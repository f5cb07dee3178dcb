"""Launchers of the fused element-wise kernels (:mod:`pensieve.kernels.triton_fused`):
argument checks, block sizes, grid. Same semantics as the ``*_ref`` functions of
:mod:`pensieve.kernels.reference`; every check raises :class:`ValueError`.
"""

from __future__ import annotations

import torch
import triton

from pensieve.kernels import triton_fused as _k
from pensieve.kernels.launch import _check_device, _check_float


def _check_rows(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    _check_float(name, t, 2)
    if t.shape != like.shape or t.dtype != like.dtype:
        raise ValueError(
            f"{name} is {tuple(t.shape)} {t.dtype}, expected {tuple(like.shape)} {like.dtype}"
        )
    _check_device(name, t, like.device)


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x [T, D]`` -> ``(weight * rmsnorm(x + residual), x + residual)``.

    With a residual, the sum is written into ``residual`` in place and returned as the second
    item (callers must use the returned tensor). weight: ``[D]`` of x's dtype.
    """
    _check_float("x", x, 2)
    _check_device("x", x, x.device)
    if weight.shape != (x.shape[1],) or weight.dtype != x.dtype:
        raise ValueError(
            f"weight is {tuple(weight.shape)} {weight.dtype}, expected ({x.shape[1]},) {x.dtype}"
        )
    _check_device("weight", weight, x.device)
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    if residual is not None:
        _check_rows("residual", residual, x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows, cols = x.shape
    if rows == 0:
        return out, residual
    block = triton.next_power_of_2(cols)
    res = residual if residual is not None else x  # unused when HAS_RESIDUAL is False
    _k._rms_norm_kernel[(rows,)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), cols, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=min(16, max(1, block // 512)),
    )
    return out, residual


def rotary_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ``[T, H, Dh]`` and k ``[T, Hkv, Dh]`` in place (any strides with a contiguous
    last dim, e.g. views of one fused qkv output) by cos/sin ``[T, R]`` (``R <= Dh``, ``R / 2``
    a power of two, laid out ``cat(freqs, freqs)``); returns ``(q, k)``."""
    _check_float("q", q, 3)
    _check_float("k", k, 3)
    _check_float("cos", cos, 2)
    _check_float("sin", sin, 2)
    tokens, _, head_dim = q.shape
    rot = cos.shape[1]
    half = rot // 2
    if k.shape[0] != tokens or k.shape[2] != head_dim or k.dtype != q.dtype:
        raise ValueError(
            f"k {tuple(k.shape)} {k.dtype} does not match q {tuple(q.shape)} {q.dtype}"
        )
    if cos.shape != (tokens, rot) or sin.shape != cos.shape:
        raise ValueError(f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)}: expected ({tokens}, R)")
    if rot > head_dim or half < 1 or rot != 2 * half or half & (half - 1):
        raise ValueError(f"rotary dim {rot}: must be 2 x a power of two and <= head_dim {head_dim}")
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        _check_device(name, t, q.device)
    if tokens == 0:
        return q, k
    _k._rotary_kernel[(tokens,)](
        q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), sin.stride(0), q.shape[1], k.shape[1],
        HALF=half, BLOCK_H=triton.next_power_of_2(max(q.shape[1], k.shape[1])), num_warps=4,
    )
    return q, k


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """``x = [gate | up]`` ``[T, 2F]`` -> ``silu(gate) * up`` ``[T, F]`` (a new tensor)."""
    _check_float("x", x, 2)
    _check_device("x", x, x.device)
    rows, width = x.shape
    if width % 2:
        raise ValueError(f"x has {width} columns: expected [gate | up], an even number")
    cols = width // 2
    out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    if rows == 0 or cols == 0:
        return out
    block = min(1024, triton.next_power_of_2(cols))
    _k._silu_mul_kernel[(rows, triton.cdiv(cols, block))](
        x, out, x.stride(0), out.stride(0), cols, BLOCK=block, num_warps=4,
    )
    return out
