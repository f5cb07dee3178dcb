"""Attention kernels and their dispatch.

``store_kv`` and ``paged_attention`` take the same arguments as the references in
:mod:`pensieve.kernels.reference`. On CUDA tensors they run the Triton kernels; on the CPU
the pure-torch references, unless ``PENSIEVE_ATTENTION=triton`` (with ``TRITON_INTERPRET=1``,
the Triton kernels then run through Triton's interpreter).
"""

from __future__ import annotations

import os

import torch

from pensieve.kernels.reference import paged_attention_ref, store_kv_ref


def _use_triton(t: torch.Tensor) -> bool:
    choice = os.environ.get("PENSIEVE_ATTENTION", "auto")
    if choice == "reference":
        return False
    if choice == "triton":
        return True
    return t.is_cuda


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:  # noqa: ANN001
    """Write K/V ``[num_tokens, num_kv_heads, head_dim]`` into their cache slots."""
    if _use_triton(key):
        from pensieve.kernels.launch import store_kv_triton

        store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(  # noqa: ANN201
    q, k_cache, v_cache, block_tables, query_start_loc, range_start_pos, range_table, scale,
    max_query_len: int, out=None,  # noqa: ANN001
):
    """Multi-token causal paged attention; see :func:`reference.paged_attention_ref`."""
    if _use_triton(q):
        from pensieve.kernels.launch import paged_attention_triton

        return paged_attention_triton(
            q, k_cache, v_cache, block_tables, query_start_loc, range_start_pos, range_table,
            scale, max_query_len=max_query_len, out=out,
        )
    return paged_attention_ref(
        q, k_cache, v_cache, block_tables, query_start_loc, range_start_pos, range_table,
        scale, out=out,
    )


__all__ = ["paged_attention", "store_kv", "paged_attention_ref", "store_kv_ref"]
