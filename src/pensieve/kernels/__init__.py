"""Triton kernels and their dispatch.

``store_kv`` and ``paged_attention`` (attention), ``rms_norm``, ``rotary`` and
``silu_and_mul`` (the decoder's fused element-wise ops) take the same arguments as the
references in :mod:`pensieve.kernels.reference`. On CUDA tensors they run the Triton kernels;
on the CPU the pure-torch references, attention through PyTorch's fused attention
(:mod:`pensieve.kernels.cpu_attention`). A test that wants the Triton kernels on the CPU
(through Triton's interpreter, ``TRITON_INTERPRET=1``), the float32 oracle (``reference``)
or the fused-attention path everywhere (``sdpa``) sets :data:`CHOICE`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pensieve.kernels.cpu_attention import paged_attention_cpu
from pensieve.kernels.reference import (
    paged_attention_ref,
    rms_norm_ref,
    rotary_ref,
    silu_and_mul_ref,
    store_kv_ref,
)


@dataclass(frozen=True)
class KernelChoice:
    """Which implementation the entry points dispatch to."""

    attention: str = "auto"
    """``auto`` (Triton on CUDA tensors, the fused-attention path elsewhere), ``triton``,
    ``reference`` (the float32 oracle) or ``sdpa`` (the fused-attention path). The
    element-wise ops run on their Triton kernels wherever attention does."""

    def __post_init__(self) -> None:
        if self.attention not in ("auto", "triton", "reference", "sdpa"):
            raise ValueError(f"kernel choice must be auto, triton, reference or sdpa, got "
                             f"{self.attention!r}")


CHOICE = KernelChoice()
"""The dispatch of every call."""


def _use_triton(t: torch.Tensor) -> bool:
    choice = CHOICE.attention
    if choice in ("reference", "sdpa"):
        return False
    if choice == "triton":
        return True
    return t.is_cuda


def triton_on(device: torch.device) -> bool:
    """Whether attention on ``device`` runs the Triton kernels (:data:`CHOICE`)."""
    return CHOICE.attention == "triton" or (CHOICE.attention == "auto"
                                             and device.type == "cuda")


def _use_fused(t: torch.Tensor) -> bool:
    return _use_triton(t)


def store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=None,  # noqa: ANN001
             v_scale=None) -> None:  # noqa: ANN001
    """Write K/V ``[num_tokens, num_kv_heads, head_dim]`` into their cache slots (an FP8
    cache: divided by the per-head ``k_scale`` / ``v_scale``)."""
    if _use_triton(key):
        from pensieve.kernels.launch import store_kv_triton

        store_kv_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        store_kv_ref(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(  # noqa: ANN201
    q, k_cache, v_cache, block_tables, query_start_loc, range_start_pos, range_table, scale,
    max_query_len: int, out=None, work_items=None, num_work_items=None, tiles=None,  # noqa: ANN001
    num_kv_splits=None, kv_split_span=None, k_scale=None, v_scale=None,  # noqa: ANN001
    long_context: bool = False, fp8_scratch=None,  # noqa: ANN001
):
    """Multi-token causal paged attention; see :func:`reference.paged_attention_ref`.
    ``work_items``, ``num_work_items``, ``tiles``: the Triton kernel's static-grid mode;
    ``num_kv_splits``, ``kv_split_span``: its KV splits (see
    :func:`launch.paged_attention_triton`), ``long_context`` its decode tile and split class;
    the reference computes the same without them.
    ``k_scale``, ``v_scale``: an FP8 cache's per-head scales. ``fp8_scratch``: an
    :class:`fp8_scratch.Fp8Scratch` plan: the Triton path (not the static-grid mode)
    dequantizes the blocks it names and runs the 16-bit kernel (the reference ignores it:
    same result)."""
    if _use_triton(q) and fp8_scratch is not None and work_items is None:
        from pensieve.kernels.fp8_scratch import paged_attention_fp8_scratch

        return paged_attention_fp8_scratch(
            q, k_cache, v_cache, fp8_scratch, query_start_loc, range_start_pos, scale,
            max_query_len, out, k_scale=k_scale, v_scale=v_scale, tiles=tiles,
            num_kv_splits=num_kv_splits, kv_split_span=kv_split_span,
            long_context=long_context,
        )
    if _use_triton(q):
        from pensieve.kernels.launch import paged_attention_triton

        return paged_attention_triton(
            q, k_cache, v_cache, block_tables, query_start_loc, range_start_pos, range_table,
            scale, max_query_len=max_query_len, out=out, tiles=tiles, work_items=work_items,
            num_work_items=num_work_items, num_kv_splits=num_kv_splits,
            kv_split_span=kv_split_span, k_scale=k_scale, v_scale=v_scale,
            long_context=long_context,
        )
    attend = paged_attention_ref if CHOICE.attention == "reference" else paged_attention_cpu
    return attend(
        q, k_cache, v_cache, block_tables, query_start_loc, range_start_pos, range_table,
        scale, out=out, k_scale=k_scale, v_scale=v_scale,
    )


def rms_norm(x, weight, eps: float, residual=None):  # noqa: ANN001, ANN201
    """``(weight * rmsnorm(x + residual), x + residual)``; see :func:`reference.rms_norm_ref`.
    The Triton path writes the sum into ``residual``'s storage: use the returned tensor."""
    if _use_fused(x) and weight.dtype == x.dtype:
        from pensieve.kernels.launch_fused import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)


def rotary(q, k, cos, sin):  # noqa: ANN001, ANN201
    """Rotary embedding of q ``[T, H, Dh]`` and k ``[T, Hkv, Dh]``: returns ``(q, k)``, which
    the Triton path rotates in place (see :func:`reference.rotary_ref`)."""
    half = cos.shape[-1] // 2
    if _use_fused(q) and half >= 1 and not half & (half - 1):
        from pensieve.kernels.launch_fused import rotary_triton

        return rotary_triton(q, k, cos, sin)
    return rotary_ref(q, cos, sin), rotary_ref(k, cos, sin)


def silu_and_mul(x):  # noqa: ANN001, ANN201
    """``silu(gate) * up`` for ``x = [gate | up]``; see :func:`reference.silu_and_mul_ref`."""
    if _use_fused(x):
        from pensieve.kernels.launch_fused import silu_and_mul_triton

        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)


__all__ = ["paged_attention", "store_kv", "rms_norm", "rotary", "silu_and_mul",
           "paged_attention_ref", "store_kv_ref", "rms_norm_ref", "rotary_ref", "silu_and_mul_ref"]
