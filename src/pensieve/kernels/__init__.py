"""Triton kernels and their dispatch.

``store_kv`` and ``paged_attention`` (attention), ``rms_norm``, ``rotary`` and
``silu_and_mul`` (the decoder's fused element-wise ops) take the same arguments as the
references in :mod:`pensieve.kernels.reference`. On CUDA tensors they run the Triton kernels;
on the CPU the pure-torch references, attention through PyTorch's fused attention
(:mod:`pensieve.kernels.cpu_attention`), unless ``PENSIEVE_ATTENTION`` says otherwise:
``triton`` (with ``TRITON_INTERPRET=1``, the Triton kernels then run through Triton's
interpreter), ``reference`` (the float32 oracle everywhere) or ``sdpa`` (the fused-attention
path everywhere).
``PENSIEVE_FUSED_OPS=0`` keeps the element-wise ops on their torch references on every device
(to measure what the fusion buys). Both variables are read once, when this module is imported,
into :data:`CHOICE`; a program (or a test) that switches later sets :data:`CHOICE`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
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
    ``reference`` (the float32 oracle) or ``sdpa`` (the fused-attention path)."""
    fused_ops: bool = True
    """Run the element-wise ops on their Triton kernels wherever attention runs on Triton."""

    def __post_init__(self) -> None:
        if self.attention not in ("auto", "triton", "reference", "sdpa"):
            raise ValueError(f"PENSIEVE_ATTENTION must be auto, triton, reference or sdpa, "
                             f"got {self.attention!r}")

    @staticmethod
    def from_env(env: Mapping[str, str] = os.environ) -> KernelChoice:
        return KernelChoice(env.get("PENSIEVE_ATTENTION", "auto"),
                            env.get("PENSIEVE_FUSED_OPS", "1") != "0")


CHOICE = KernelChoice.from_env()
"""The dispatch of every call, from the environment at import."""


def _use_triton(t: torch.Tensor) -> bool:
    choice = CHOICE.attention
    if choice in ("reference", "sdpa"):
        return False
    if choice == "triton":
        return True
    return t.is_cuda


def _use_fused(t: torch.Tensor) -> bool:
    return CHOICE.fused_ops and _use_triton(t)


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:  # noqa: ANN001
    """Write K/V ``[num_tokens, num_kv_heads, head_dim]`` into their cache slots."""
    if _use_triton(key):
        from pensieve.kernels.launch import store_kv_triton

        store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(  # noqa: ANN201
    q, k_cache, v_cache, block_tables, query_start_loc, range_start_pos, range_table, scale,
    max_query_len: int, out=None, work_items=None, num_work_items=None, tiles=None,  # noqa: ANN001
    num_kv_splits=None, kv_split_span=None,  # noqa: ANN001
):
    """Multi-token causal paged attention; see :func:`reference.paged_attention_ref`.
    ``work_items``, ``num_work_items``, ``tiles``: the Triton kernel's static-grid mode;
    ``num_kv_splits``, ``kv_split_span``: its KV splits (see
    :func:`launch.paged_attention_triton`); the reference computes the same without them."""
    if _use_triton(q):
        from pensieve.kernels.launch import paged_attention_triton

        return paged_attention_triton(
            q, k_cache, v_cache, block_tables, query_start_loc, range_start_pos, range_table,
            scale, max_query_len=max_query_len, out=out, tiles=tiles, work_items=work_items,
            num_work_items=num_work_items, num_kv_splits=num_kv_splits,
            kv_split_span=kv_split_span,
        )
    attend = paged_attention_ref if CHOICE.attention == "reference" else paged_attention_cpu
    return attend(
        q, k_cache, v_cache, block_tables, query_start_loc, range_start_pos, range_table,
        scale, out=out,
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
