"""Pure-torch references of the attention kernels: the tests' oracle and the engine's CPU path.

KV cache layout (one per layer and per K / V): ``[num_blocks, chunk_size, num_kv_heads,
head_dim]``. A *slot* is ``block * chunk_size + offset``.
"""

from __future__ import annotations

import torch


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V into their slots; slots < 0 are skipped.

    key, value: ``[num_tokens, num_kv_heads, head_dim]``; slot_mapping: ``[num_tokens]`` int.
    """
    num_blocks, chunk_size = k_cache.shape[:2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_flat = k_cache.view(num_blocks * chunk_size, *k_cache.shape[2:])
    v_flat = v_cache.view(num_blocks * chunk_size, *v_cache.shape[2:])
    k_flat[slots] = key[keep].to(k_cache.dtype)
    v_flat[slots] = value[keep].to(v_cache.dtype)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    range_start_pos: torch.Tensor,
    range_table: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ragged query ranges over paged KV, computed in float32.

    q: ``[num_tokens, num_heads, head_dim]``; block_tables: ``[num_tables, max_blocks]`` int;
    query_start_loc: ``[num_ranges + 1]`` cumulative query offsets into ``q``;
    range_start_pos: ``[num_ranges]`` position of each range's first query token;
    range_table: ``[num_ranges]`` row of ``block_tables`` each range reads.
    Query token ``i`` of range ``r`` sits at position ``p = range_start_pos[r] + i`` and attends
    to cached positions ``0..p`` of its table. Returns ``[num_tokens, num_heads, head_dim]``.
    """
    num_tokens, num_heads, head_dim = q.shape
    chunk_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    qsl = query_start_loc.tolist()
    starts = range_start_pos.tolist()
    tables = range_table.tolist()
    for r in range(len(starts)):
        q_lo, q_hi = qsl[r], qsl[r + 1]
        if q_hi == q_lo:
            continue
        query_len = q_hi - q_lo
        ctx = starts[r] + query_len
        n_blocks = (ctx + chunk_size - 1) // chunk_size
        blocks = block_tables[tables[r], :n_blocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].float()
        k = k.repeat_interleave(group, dim=1)  # [ctx, H, D]
        v = v.repeat_interleave(group, dim=1)
        qr = q[q_lo:q_hi].float()  # [query_len, H, D]
        scores = torch.einsum("qhd,khd->hqk", qr, k) * scale  # [H, query_len, ctx]
        q_pos = torch.arange(starts[r], ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        scores.masked_fill_(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_lo:q_hi] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out
