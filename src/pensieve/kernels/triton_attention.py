"""Triton kernels of the paged KV cache: the KV store and multi-token causal paged attention.

Raw ``@triton.jit`` kernels only; :mod:`pensieve.kernels.launch` validates arguments and
launches them. Cache layout (per layer, K and V each): ``[num_blocks, chunk_size,
num_kv_heads, head_dim]`` with any strides except a contiguous last dimension; a *slot* is
``block * chunk_size + offset``. All cache addresses are computed in int64, so caches of more
than 2**31 elements work.

Attention design (``_paged_attention_kernel``):

* Grid ``(num_ranges, cdiv(max_query_len * GROUP, BLOCK_M), num_kv_heads)``. One program owns
  one KV head and a tile of ``BLOCK_M`` *rows* of one query range, where the rows flatten
  (query token, query head of the KV head's group): row ``m`` is token ``m // GROUP`` and query
  head ``kv_head * GROUP + m % GROUP``. Each K/V tile is therefore loaded once for the whole
  GQA group, and no rows are wasted on padding for non-power-of-two groups. Programs whose
  tile starts past the range's end exit at once.
* KV is walked in tiles of ``BLOCK_N`` positions; each position's block id is gathered from
  the range's block-table row, so a tile may span several (non-contiguous) cache blocks.
  Positions are visited only up to the tile's last query position. Tiles lying entirely at
  or before the tile's first query position need no mask; the rest apply the causal mask
  ``kv_pos <= q_pos``.
* Split-KV ("flash decoding") for grids too small to fill the GPU (decode of few, long
  requests): each program covers one of ``num_splits`` slices of its KV range and writes fp32
  partials (up to 128 splits for decode at long contexts, 32 in the static-grid mode);
  ``_combine_splits_kernel`` merges them with their softmax weights, 32 splits at a time.
  Ragged decode steps split by *span* instead (pieces of at least a per-step length read
  from device memory, each range using only the splits it needs): the longest request no
  longer runs on alone.
  The static-grid mode of CUDA graphs (work items) splits the same way, by span, so that a
  turn of a few tokens after a long history does not run on a handful of programs;
  ``_combine_items_kernel`` merges its partials item by item.
* Online softmax (base 2, scale folded in) with fp32 statistics and accumulator; the score
  tile lives in registers only. fp16/bf16 inputs use the native tensor-core dot with fp32
  accumulation; ``FP32`` makes both dots exact float32 ("ieee", no tf32). The launcher also
  sets ``FP32`` for bf16 under Triton's interpreter, whose ``tl.dot`` mistakes bf16 (stored as
  uint16 in numpy) for integers.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX: tl.constexpr = tl.constexpr(448.0)
"""Largest finite float8 e4m3fn value: FP8 KV is saturated to it."""
P_SCALE: tl.constexpr = tl.constexpr(256.0)
"""``FP8_DOT``: the probabilities (in [0, 1]) times this before their e4m3 rounding, so that
small ones keep their mantissa instead of falling among e4m3's subnormals."""


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_kc_b,
    stride_kc_c,
    stride_kc_h,
    stride_vc_b,
    stride_vc_c,
    stride_vc_h,
    num_kv_heads,
    CHUNK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """One program per token: copy its ``[num_kv_heads, head_dim]`` K and V into its slot.
    With ``KV_FP8`` each head is divided by its scale (``k_scale_ptr`` / ``v_scale_ptr``:
    ``[num_kv_heads]`` float32) and saturated to e4m3's range before the cast."""
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    block = slot // CHUNK_SIZE
    offset = slot % CHUNK_SIZE
    h = tl.arange(0, BLOCK_H).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    mask = (h < num_kv_heads)[:, None]

    k = tl.load(key_ptr + tok * stride_key_t + h[:, None] * stride_key_h + d[None, :], mask=mask)
    v = tl.load(
        value_ptr + tok * stride_value_t + h[:, None] * stride_value_h + d[None, :], mask=mask
    )
    if KV_FP8:
        ks = tl.load(k_scale_ptr + h, mask=h < num_kv_heads, other=1.0)
        vs = tl.load(v_scale_ptr + h, mask=h < num_kv_heads, other=1.0)
        k = tl.clamp(k.to(tl.float32) / ks[:, None], -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) / vs[:, None], -FP8_MAX, FP8_MAX)
    k_dst = k_cache_ptr + block * stride_kc_b + offset * stride_kc_c
    v_dst = v_cache_ptr + block * stride_vc_b + offset * stride_vc_c
    tl.store(
        k_dst + h[:, None] * stride_kc_h + d[None, :],
        k.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_dst + h[:, None] * stride_vc_h + d[None, :],
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _attn_kv_tile(
    acc,
    m_i,
    l_i,
    q,
    q_row_scale,
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
    FP8_DOT: tl.constexpr,
):
    """Fold KV positions ``start_n .. start_n + BLOCK_N - 1`` into the running softmax.
    ``FP8_DOT``: ``q`` and the cache's tiles are e4m3 and both products take them as they
    are (``q_row_scale`` ``[BLOCK_M]`` scales each row's scores back; ``P_SCALE`` times the
    probabilities rounded to e4m3 for the second product)."""
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

    if FP8_DOT:
        # e4m3 x e4m3 -> fp32 (Hopper: wgmma with FP8 inputs)
        s = tl.dot(q, tl.trans(k)) * q_row_scale[:, None]
    elif FP32:
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
    if FP8_DOT:  # p in [0, 1] scaled up so that small probabilities keep e4m3's mantissa
        acc += tl.dot((p * P_SCALE).to(v.dtype), v) * (1.0 / P_SCALE)
    elif FP32:
        acc = tl.dot(p, v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    range_start_pos_ptr,
    range_table_ptr,
    k_scale_ptr,
    v_scale_ptr,
    q_scale_ptr,
    scale_log2,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_kc_b,
    stride_kc_c,
    stride_kc_h,
    stride_vc_b,
    stride_vc_c,
    stride_vc_h,
    stride_bt,
    ws_acc_ptr,
    ws_m_ptr,
    ws_l_ptr,
    num_heads,
    num_splits,
    work_ptr,
    num_work_ptr,
    span_ptr,
    GROUP: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32: tl.constexpr,
    SPLIT: tl.constexpr,
    WORKLIST: tl.constexpr,
    SPAN: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_DOT: tl.constexpr = False,
):
    """Causal attention of one (range, row tile, KV head); rows = query tokens x group heads.

    With ``KV_FP8`` the cache holds float8 e4m3 values of ``K / k_scale``, ``V / v_scale``
    per KV head: the K scale folds into the softmax scale and the V scale multiplies the
    (partial) output, so the tiles are only upcast. With ``FP8_DOT`` they are not even
    upcast: ``q_ptr`` holds e4m3 queries, each (token, head) row divided by its scale
    ``q_scale_ptr[token * num_heads + head]`` (float32), and both products take e4m3
    operands, the probabilities times ``P_SCALE`` for the second (issue 59's prefill path).

    With ``SPLIT`` program ``(r, tile * num_splits + split, kv_head)`` covers only the
    ``split``-th of ``num_splits`` equal, ``BLOCK_N``-aligned parts of the tile's KV range
    and writes its unnormalised partial result to contiguous fp32 workspaces: ``ws_acc``
    ``[num_tokens, num_heads, num_splits, HEAD_DIM]``, and ``ws_m`` / ``ws_l``
    ``[num_tokens, num_heads, num_splits]`` (running max, base 2, and sum);
    ``_combine_splits_kernel`` merges them. ``num_splits`` and the block table's row stride
    are plain (unspecialised) ints, so a serving run compiles one kernel per tile shape and
    ``SPLIT``, not one per split count or table width.

    With ``SPAN`` (decode only: one query token per range) a split covers at least
    ``span_ptr[0]`` positions (a multiple of ``BLOCK_N``, read from device memory so that a
    CUDA graph follows the step's contexts): ``max(equal part, span)``. A range then uses only
    as many splits as its length needs, and the programs of its other splits exit at once
    without writing; ``_combine_splits_kernel`` recomputes which splits wrote. A tile whose
    KV fits one split (``kv_len <= max(equal part, span)``) writes ``out`` itself, normalised,
    and the combiners skip it (they recompute the same condition). Long ranges
    are cut into pieces near the batch's mean, so one long request no longer keeps its
    program running long after the others have finished.

    With ``WORKLIST`` the grid is ``(max_items, 1, num_kv_heads)``: program ``i`` takes work
    item ``work[i] = range * 65536 + tile * 32 + split`` if ``i < num_work[0]`` and exits
    otherwise. The grid then depends only on a bound of the item count, not on the ranges, so
    a step whose ranges change from step to step can replay from a CUDA graph. With ``SPLIT``
    (and ``SPAN``, any range length) the host lists each tile once per split it uses
    (``launch.work_items_for``), and ``_combine_items_kernel`` merges the partials.
    """
    if WORKLIST:
        item = tl.program_id(0)
        if item >= tl.load(num_work_ptr):
            return
        packed = tl.load(work_ptr + item)
        rng = packed // 65536
        tile = (packed % 65536) // 32
        split = packed % 32  # 0 unless SPLIT
    else:
        rng = tl.program_id(0)
        tile = tl.program_id(1) // num_splits
        split = tl.program_id(1) % num_splits
    kv_head = tl.program_id(2)

    q_lo = tl.load(query_start_loc_ptr + rng)
    q_hi = tl.load(query_start_loc_ptr + rng + 1)
    query_len = q_hi - q_lo
    row0 = tile * BLOCK_M
    if row0 >= query_len * GROUP:
        return
    if KV_FP8:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr + kv_head)
    start_pos = tl.load(range_start_pos_ptr + rng)
    last_qi = tl.minimum((row0 + BLOCK_M - 1) // GROUP, query_len - 1)
    kv_len = start_pos + last_qi + 1  # no row of this tile sees beyond kv_len - 1
    kv_lo = 0
    kv_hi = kv_len
    if SPLIT:
        per_split = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
        if SPAN:
            per_split = tl.maximum(per_split, tl.load(span_ptr))
        kv_lo = split * per_split
        kv_hi = tl.minimum(kv_lo + per_split, kv_len)
        if SPAN:
            if kv_lo >= kv_len:
                return
    table_row = tl.load(range_table_ptr + rng).to(tl.int64)
    table_ptr = block_tables_ptr + table_row * stride_bt

    rows = row0 + tl.arange(0, BLOCK_M)
    qi = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = qi < query_len
    tok = (q_lo + qi).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + tok[:, None] * stride_q_t + head[:, None].to(tl.int64) * stride_q_h + d[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )
    q_row_scale = tl.zeros([BLOCK_M], dtype=tl.float32)  # read only with FP8_DOT
    if FP8_DOT:  # q is e4m3 already, each (token, head) row over its own scale
        q_row_scale = tl.load(q_scale_ptr + tok * num_heads + head, mask=row_valid, other=0.0)
    elif FP32:
        q = q.to(tl.float32)
    elif KV_FP8:
        # e4m3 -> fp16 is one conversion per two elements on Hopper (bf16 takes several), so
        # an FP8 cache attends in fp16: q and the probabilities are rounded to fp16 instead
        # of bf16 (3 more mantissa bits; q beyond fp16's 65504 would overflow).
        q = q.to(tl.float16)
    q_pos = start_pos + qi

    first_pos = start_pos + row0 // GROUP  # every valid row sees positions 0..first_pos
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    for start_n in range(kv_lo, tl.minimum(full_end, kv_hi), BLOCK_N):
        acc, m_i, l_i = _attn_kv_tile(
            acc, m_i, l_i, q, q_row_scale, q_pos, start_n, kv_len, k_cache_ptr, v_cache_ptr,
            table_ptr, kv_head, stride_kc_b, stride_kc_c, stride_kc_h, stride_vc_b, stride_vc_c,
            stride_vc_h, scale_log2, CHUNK_SIZE, HEAD_DIM, BLOCK_N, False, FP32, FP8_DOT,
        )
    for start_n in range(tl.maximum(full_end, kv_lo), kv_hi, BLOCK_N):
        acc, m_i, l_i = _attn_kv_tile(
            acc, m_i, l_i, q, q_row_scale, q_pos, start_n, kv_len, k_cache_ptr, v_cache_ptr,
            table_ptr, kv_head, stride_kc_b, stride_kc_c, stride_kc_h, stride_vc_b, stride_vc_c,
            stride_vc_h, scale_log2, CHUNK_SIZE, HEAD_DIM, BLOCK_N, True, FP32, FP8_DOT,
        )

    o_ptrs = (out_ptr + tok[:, None] * stride_o_t + head[:, None].to(tl.int64) * stride_o_h
              + d[None, :])
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr + kv_head)
    direct = not SPLIT
    if SPLIT:
        if SPAN:  # the tile's only split writes the output: no partials, no combine
            direct = kv_len <= per_split
    if direct:
        tl.store(o_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
                 mask=row_valid[:, None])
    else:
        # An empty split (kv_lo >= kv_len) leaves m = -1e30, l = 0: weight 0 when combined.
        ws_row = (tok * num_heads + head) * num_splits + split
        tl.store(ws_acc_ptr + ws_row[:, None] * HEAD_DIM + d[None, :], acc,
                 mask=row_valid[:, None])
        tl.store(ws_m_ptr + ws_row, m_i, mask=row_valid)
        tl.store(ws_l_ptr + ws_row, l_i, mask=row_valid)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits_kernel(
    out_ptr,
    ws_acc_ptr,
    ws_m_ptr,
    ws_l_ptr,
    query_start_loc_ptr,
    range_start_pos_ptr,
    span_ptr,
    stride_o_t,
    stride_o_h,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPAN: tl.constexpr,
):
    """Merge the split-KV partials of one (range, query token, head) into ``out``, ``BLOCK_S``
    splits at a time with an online softmax (any ``num_splits``: a lone long request's decode
    uses up to 128). With ``SPAN`` (one query token per range) only the splits that start
    before the range's KV length wrote partials: the others are skipped, as the attention
    kernel computed them."""
    rng = tl.program_id(0)
    qi = tl.program_id(1)
    head = tl.program_id(2)
    q_lo = tl.load(query_start_loc_ptr + rng)
    q_hi = tl.load(query_start_loc_ptr + rng + 1)
    if qi >= q_hi - q_lo:
        return
    tok = (q_lo + qi).to(tl.int64)
    used = num_splits
    if SPAN:
        kv_len = tl.load(range_start_pos_ptr + rng) + 1
        per_split = tl.maximum(tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N,
                               tl.load(span_ptr))
        if kv_len <= per_split:  # one split: the attention kernel wrote out itself
            return
        used = tl.minimum(tl.cdiv(kv_len, per_split), num_splits)
    d = tl.arange(0, HEAD_DIM)
    row0 = (tok * num_heads + head) * num_splits
    m_run = tl.max(tl.full([BLOCK_S], -1.0e30, dtype=tl.float32), 0)
    l_run = tl.sum(tl.zeros([BLOCK_S], dtype=tl.float32), 0)
    acc_run = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for s0 in range(0, used, BLOCK_S):
        splits = s0 + tl.arange(0, BLOCK_S)
        valid = splits < used
        ws_row = row0 + splits
        m = tl.load(ws_m_ptr + ws_row, mask=valid, other=-1.0e30)
        l_sum = tl.load(ws_l_ptr + ws_row, mask=valid, other=0.0)
        acc = tl.load(ws_acc_ptr + ws_row[:, None] * HEAD_DIM + d[None, :],
                      mask=valid[:, None], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, 0))
        a = tl.exp2(m_run - m_new)
        w = tl.exp2(m - m_new)
        acc_run = acc_run * a + tl.sum(acc * w[:, None], 0)
        l_run = l_run * a + tl.sum(l_sum * w, 0)
        m_run = m_new
    tl.store(
        out_ptr + tok * stride_o_t + head * stride_o_h + d,
        (acc_run / l_run).to(out_ptr.dtype.element_ty),
    )


@triton.jit(do_not_specialize=["num_splits"])
def _combine_items_kernel(
    out_ptr,
    ws_acc_ptr,
    ws_m_ptr,
    ws_l_ptr,
    query_start_loc_ptr,
    range_start_pos_ptr,
    work_ptr,
    num_work_ptr,
    span_ptr,
    stride_o_t,
    stride_o_h,
    num_heads,
    num_splits,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Merge the split-KV partials of the static-grid mode (``WORKLIST`` with ``SPLIT``,
    always by span):
    program ``(i, 0, kv_head)``, where work item ``i`` is a tile's first split, merges the
    rows of that tile, one split after another with an online softmax, and writes them to
    ``out``. It recomputes the tile's KV length and split length as the attention kernel did,
    so it reads only the splits that wrote. Grid and item count as the
    attention launch's, so a CUDA graph replays it for any ranges."""
    item = tl.program_id(0)
    if item >= tl.load(num_work_ptr):
        return
    packed = tl.load(work_ptr + item)
    if packed % 32 != 0:  # the tile's first split's item merges all of them
        return
    rng = packed // 65536
    tile = (packed % 65536) // 32
    kv_head = tl.program_id(2)
    q_lo = tl.load(query_start_loc_ptr + rng)
    query_len = tl.load(query_start_loc_ptr + rng + 1) - q_lo
    row0 = tile * BLOCK_M
    if row0 >= query_len * GROUP:
        return
    start_pos = tl.load(range_start_pos_ptr + rng)
    last_qi = tl.minimum((row0 + BLOCK_M - 1) // GROUP, query_len - 1)
    kv_len = start_pos + last_qi + 1
    per_split = tl.maximum(tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N,
                           tl.load(span_ptr))
    used = tl.minimum(tl.cdiv(kv_len, per_split), num_splits)
    if used <= 1:  # one split: the attention kernel wrote out itself
        return

    rows = row0 + tl.arange(0, BLOCK_M)
    qi = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = qi < query_len
    tok = (q_lo + qi).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    ws_row0 = (tok * num_heads + head) * num_splits
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for split in range(0, used):
        ws_row = ws_row0 + split
        m_s = tl.load(ws_m_ptr + ws_row, mask=row_valid, other=-1.0e30)
        l_s = tl.load(ws_l_ptr + ws_row, mask=row_valid, other=0.0)
        acc_s = tl.load(ws_acc_ptr + ws_row[:, None] * HEAD_DIM + d[None, :],
                        mask=row_valid[:, None], other=0.0)
        m_new = tl.maximum(m_i, m_s)
        a = tl.exp2(m_i - m_new)
        b = tl.exp2(m_s - m_new)
        acc = acc * a[:, None] + acc_s * b[:, None]
        l_i = l_i * a + l_s * b
        m_i = m_new
    l_i = tl.where(row_valid, l_i, 1.0)
    tl.store(
        out_ptr + tok[:, None] * stride_o_t + head[:, None].to(tl.int64) * stride_o_h
        + d[None, :],
        (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None],
    )
