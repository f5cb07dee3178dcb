"""Pure-torch references of the Triton kernels: the tests' oracle and the engine's CPU path.

KV cache layout (one per layer and per K / V): ``[num_blocks, chunk_size, num_kv_heads,
head_dim]``. A *slot* is ``block * chunk_size + offset``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write new K/V into their slots; slots < 0 are skipped.

    key, value: ``[num_tokens, num_kv_heads, head_dim]``; slot_mapping: ``[num_tokens]`` int.
    k_scale, v_scale: ``[num_kv_heads]`` float32, for an FP8 cache: it stores ``K / k_scale``
    and ``V / v_scale`` saturated to e4m3's +-448.
    """
    num_blocks, chunk_size = k_cache.shape[:2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_flat = k_cache.view(num_blocks * chunk_size, *k_cache.shape[2:])
    v_flat = v_cache.view(num_blocks * chunk_size, *v_cache.shape[2:])
    k_flat[slots] = _to_cache(key[keep], k_cache.dtype, k_scale)
    v_flat[slots] = _to_cache(value[keep], v_cache.dtype, v_scale)


FP8_MAX = 448.0
"""Largest finite float8 e4m3fn value."""


def _to_cache(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """``x [n, heads, dim]`` as the cache stores it: divided by its per-head ``scale`` and
    saturated for an FP8 cache, else just cast."""
    if scale is None:
        return x.to(dtype)
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def read_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, ctx: int,
    dtype: torch.dtype, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions ``0 .. ctx - 1`` through one block-table row, each
    ``[ctx, num_kv_heads, head_dim]`` in ``dtype``: the one place the reference and the CPU
    path (:mod:`pensieve.kernels.cpu_attention`) read the paged cache.

    table: ``[max_blocks]`` int block ids (entries past the context's blocks are not read).
    Consecutive block ids (a long prompt's usual allocation) are read as a view of the cache,
    not copied: callers only read the result. An FP8 cache's values are multiplied by their
    per-head ``k_scale`` / ``v_scale`` (``[num_kv_heads]``).
    """
    chunk_size, num_kv_heads, head_dim = k_cache.shape[1:]
    n = (ctx + chunk_size - 1) // chunk_size
    ids = table[:n].tolist()
    if ids == list(range(ids[0], ids[0] + n)):  # consecutive blocks: a view, no copy
        k, v = k_cache[ids[0]:ids[0] + n], v_cache[ids[0]:ids[0] + n]
    else:
        blocks = table[:n].long()
        k, v = k_cache[blocks], v_cache[blocks]
    k = k.reshape(-1, num_kv_heads, head_dim)[:ctx]
    v = v.reshape(-1, num_kv_heads, head_dim)[:ctx]
    if k_scale is not None:
        k = k.float() * k_scale[:, None]
    if v_scale is not None:
        v = v.float() * v_scale[:, None]
    return k.to(dtype), v.to(dtype)


def range_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, range_start_pos: torch.Tensor, range_table: torch.Tensor,
    dtype: torch.dtype, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> Iterator[tuple[int, int, int, torch.Tensor, torch.Tensor]]:
    """Each non-empty query range of a step as ``(q_lo, q_hi, start_pos, k, v)``: its rows of
    ``q``, its first position, and the K/V it attends to (:func:`read_kv`, positions
    ``0 .. start_pos + q_hi - q_lo - 1``): the walk both CPU attention paths share."""
    qsl = query_start_loc.tolist()
    starts = range_start_pos.tolist()
    tables = range_table.tolist()
    for r, start in enumerate(starts):
        q_lo, q_hi = qsl[r], qsl[r + 1]
        if q_hi == q_lo:
            continue
        k, v = read_kv(k_cache, v_cache, block_tables[tables[r]], start + q_hi - q_lo, dtype,
                       k_scale, v_scale)
        yield q_lo, q_hi, start, k, v


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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ragged query ranges over paged KV, computed in float32.

    q: ``[num_tokens, num_heads, head_dim]``; block_tables: ``[num_tables, max_blocks]`` int;
    query_start_loc: ``[num_ranges + 1]`` cumulative query offsets into ``q``;
    range_start_pos: ``[num_ranges]`` position of each range's first query token;
    range_table: ``[num_ranges]`` row of ``block_tables`` each range reads.
    Query token ``i`` of range ``r`` sits at position ``p = range_start_pos[r] + i`` and attends
    to cached positions ``0..p`` of its table. k_scale, v_scale: an FP8 cache's per-head
    scales (:func:`read_kv`). Returns ``[num_tokens, num_heads, head_dim]``.
    """
    group = q.shape[1] // k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    for q_lo, q_hi, start, k, v in range_kv(
            k_cache, v_cache, block_tables, query_start_loc, range_start_pos, range_table,
            torch.float32, k_scale, v_scale):
        ctx = start + q_hi - q_lo
        k = k.repeat_interleave(group, dim=1)  # [ctx, H, D]
        v = v.repeat_interleave(group, dim=1)
        qr = q[q_lo:q_hi].float()  # [query_len, H, D]
        scores = torch.einsum("qhd,khd->hqk", qr, k) * scale  # [H, query_len, ctx]
        q_pos = torch.arange(start, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        scores.masked_fill_(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_lo:q_hi] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """HF's LlamaRMSNorm, after an optional residual add: ``x [T, D]`` (plus ``residual``) ->
    ``(weight * normed, x + residual)``; normalised in float32, cast back, then scaled."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), residual


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: ``[T, heads, head_dim]``; cos/sin: ``[T, rotary_dim]`` in x's dtype, laid out
    ``cat(freqs, freqs)``.

    Rotates the first ``rotary_dim`` channels of each head (all of them unless the config has a
    ``partial_rotary_factor``); returns a new ``[T, heads, head_dim]`` tensor.
    """
    rot = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, R]
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``x = [gate | up]`` ``[T, 2F]`` -> ``silu(gate) * up`` ``[T, F]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def swap_blocks_ref(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
    """``dst[:, :, d] = src[:, :, s]`` for every row ``(s, d)`` of ``pairs``: whole KV blocks of
    every layer, K and V (the swapper's copy; see :mod:`pensieve.kernels.triton_swap`).

    src, dst: ``[layers, 2, blocks, chunk_size, num_kv_heads, head_dim]`` of one dtype (block
    counts may differ; devices too); pairs: ``[n, 2]`` int64 with distinct dst ids.
    """
    if pairs.numel() == 0:
        return
    s = pairs[:, 0].to(src.device)
    d = pairs[:, 1].to(dst.device)
    dst[:, :, d] = src[:, :, s].to(dst.device)
