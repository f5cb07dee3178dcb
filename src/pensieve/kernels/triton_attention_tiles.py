"""The KV-tile step of :func:`pensieve.kernels.triton_attention._paged_attention_kernel`: fold
one tile of ``BLOCK_N`` KV positions into a row tile's online softmax (base 2, fp32 running
max, sum and accumulator).

Two forms of the same step:

* :func:`_attn_kv_tile` (the default): ``S = Q @ K^T`` then ``acc += P @ V``. Q and P are
  each dot's first operand and the K and V tiles the second; on Hopper a wgmma reads its
  second operand from shared memory, so K and V, when the cache is FP8 and upcast to fp16 in
  registers between the load and the dot, are written back to shared memory before each dot.
* :func:`_attn_kv_tile_t` (``KV_T``, a variant for an FP8 cache, selectable by the launcher's
  ``kv_transposed`` and ``pensieve bench long-attention --fp8-variant transposed``): ``S^T =
  K @ Q^T`` then ``acc^T += V^T @ P^T``. The upcast K and V are the first (register)
  operands; what goes through shared memory is the query (once per program) and the fp16
  probabilities (``BLOCK_N x BLOCK_M`` per tile, against ``2 x BLOCK_N x HEAD_DIM`` for K and
  V). Same numbers up to rounding; not the default, as nobody has timed it on a GPU yet.

:func:`_merge_splits` is the split combine of the kernel's ``FUSED`` variant (launcher
``fused_combine``): the last split program of a (range, row tile, KV head) to finish, told by
an atomic counter, merges the partials itself, so a split decode is one launch, not two.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _attn_kv_tile(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    start_n,
    kv_len,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    kv_head,
    stride_kc_b,
    stride_kc_c,
    stride_kc_h,
    stride_vc_b,
    stride_vc_c,
    stride_vc_h,
    scale_log2,
    CHUNK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    FP32: tl.constexpr,
):
    """Fold KV positions ``start_n .. start_n + BLOCK_N - 1`` into the running softmax."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    if MASKED:
        in_range = offs_n < kv_len
        block = tl.load(table_ptr + offs_n // CHUNK_SIZE, mask=in_range, other=0).to(tl.int64)
    else:
        block = tl.load(table_ptr + offs_n // CHUNK_SIZE).to(tl.int64)
    within = (offs_n % CHUNK_SIZE).to(tl.int64)
    k_off = block * stride_kc_b + within * stride_kc_c + kv_head * stride_kc_h
    v_off = block * stride_vc_b + within * stride_vc_c + kv_head * stride_vc_h
    if MASKED:
        k = tl.load(k_cache_ptr + k_off[:, None] + d[None, :], mask=in_range[:, None], other=0.0)
        v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :], mask=in_range[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + k_off[:, None] + d[None, :])
        v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :])

    if FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        k = k.to(q.dtype)  # FP8 KV: upcast to fp16 in registers (no-op for a 16-bit cache)
        v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k))
    s = s * scale_log2
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & in_range[None, :]
        s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if FP32:
        acc = tl.dot(p, v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i



@triton.jit
def _attn_kv_tile_t(
    acc_t,
    m_i,
    l_i,
    q_t,
    q_pos,
    start_n,
    kv_len,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    kv_head,
    stride_kc_b,
    stride_kc_c,
    stride_kc_h,
    stride_vc_b,
    stride_vc_c,
    stride_vc_h,
    scale_log2,
    CHUNK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    FP32: tl.constexpr,
):
    """:func:`_attn_kv_tile` transposed: ``S^T = K @ Q^T`` (``[BLOCK_N, BLOCK_M]``) and
    ``acc^T += V^T @ P^T``, so the loaded (and, from FP8, upcast) K and V tiles are each dot's
    first operand, which a Hopper wgmma may read from registers, and the query (loaded once)
    and the probabilities are the second, read from shared memory."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    if MASKED:
        in_range = offs_n < kv_len
        block = tl.load(table_ptr + offs_n // CHUNK_SIZE, mask=in_range, other=0).to(tl.int64)
    else:
        block = tl.load(table_ptr + offs_n // CHUNK_SIZE).to(tl.int64)
    within = (offs_n % CHUNK_SIZE).to(tl.int64)
    k_off = block * stride_kc_b + within * stride_kc_c + kv_head * stride_kc_h
    v_off = block * stride_vc_b + within * stride_vc_c + kv_head * stride_vc_h
    if MASKED:
        k = tl.load(k_cache_ptr + k_off[:, None] + d[None, :], mask=in_range[:, None], other=0.0)
        v_t = tl.load(v_cache_ptr + v_off[None, :] + d[:, None], mask=in_range[None, :],
                      other=0.0)
    else:
        k = tl.load(k_cache_ptr + k_off[:, None] + d[None, :])
        v_t = tl.load(v_cache_ptr + v_off[None, :] + d[:, None])
    if FP32:
        s_t = tl.dot(k.to(tl.float32), q_t, input_precision="ieee")
    else:
        s_t = tl.dot(k.to(q_t.dtype), q_t)
    s_t = s_t * scale_log2
    if MASKED:
        visible = (offs_n[:, None] <= q_pos[None, :]) & in_range[:, None]
        s_t = tl.where(visible, s_t, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s_t, 0))
    alpha = tl.exp2(m_i - m_new)
    p_t = tl.exp2(s_t - m_new[None, :])
    l_i = l_i * alpha + tl.sum(p_t, 0)
    acc_t = acc_t * alpha[None, :]
    if FP32:
        acc_t = tl.dot(v_t.to(tl.float32), p_t, acc_t, input_precision="ieee")
    else:
        acc_t = tl.dot(v_t.to(q_t.dtype), p_t.to(q_t.dtype), acc_t)
    return acc_t, m_new, l_i


@triton.jit
def _merge_splits(ws_acc_ptr, ws_m_ptr, ws_l_ptr, ws_row0, row_valid, used,
                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """The normalised merge of ``used`` split partials of ``BLOCK_M`` rows (workspace rows
    ``ws_row0 + split``), for the attention kernel's ``FUSED`` combine: loads bypass L1
    (``.cg``), as other SMs wrote the partials."""
    d = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for split in range(0, used):
        ws_row = ws_row0 + split
        m_s = tl.load(ws_m_ptr + ws_row, mask=row_valid, other=-1.0e30, cache_modifier=".cg")
        l_s = tl.load(ws_l_ptr + ws_row, mask=row_valid, other=0.0, cache_modifier=".cg")
        acc_s = tl.load(ws_acc_ptr + ws_row[:, None] * HEAD_DIM + d[None, :],
                        mask=row_valid[:, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_i, m_s)
        a = tl.exp2(m_i - m_new)
        b = tl.exp2(m_s - m_new)
        acc = acc * a[:, None] + acc_s * b[:, None]
        l_i = l_i * a + l_s * b
        m_i = m_new
    return acc / tl.where(row_valid, l_i, 1.0)[:, None]
