"""Launchers of the Triton attention kernels: argument checks, tile choice, grid.

Same semantics as :mod:`pensieve.kernels.reference`. The kernels run on CUDA tensors, or on
CPU tensors through Triton's interpreter when ``TRITON_INTERPRET=1`` was set before
:mod:`pensieve.kernels.triton_attention` was first imported. Every check raises
:class:`ValueError`. No check synchronises with the device, so index *values* (slots, block
ids, query offsets) are trusted.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np
import torch
import triton

from pensieve.kernels import triton_attention as _k
from pensieve.kernels.launch_policy import DECODE_MAX_SPLITS as _DECODE_MAX_SPLITS
from pensieve.kernels.launch_policy import MAX_SPLITS as _MAX_SPLITS
from pensieve.kernels.launch_policy import launch_kv_splits

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_KV = torch.float8_e4m3fn
"""The FP8 KV cache dtype (``--kv-cache-dtype fp8_e4m3``): values of K / scale, V / scale."""
_INDEX_DTYPES = (torch.int32, torch.int64)
_LOG2E = 1.4426950408889634


def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (all tensors on one device)")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{name} is on {device}: the Triton kernels need CUDA tensors, or CPU tensors with "
            "TRITON_INTERPRET=1 set before pensieve.kernels.triton_attention is imported"
        )


def _check_float(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")


def _check_index(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")


def _check_head_dim(head_dim: int) -> None:
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype == FP8_KV:
            if t.dim() != 4 or (t.numel() and t.stride(-1) != 1):
                raise ValueError(f"{name} must be 4-D with a contiguous last dim, got shape "
                                 f"{tuple(t.shape)} strides {t.stride()}")
        else:
            _check_float(name, t, 4)
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape"
        )
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {k_cache.dtype} and v_cache {v_cache.dtype} differ in dtype")
    _check_head_dim(k_cache.shape[3])


def _kv_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None,
               v_scale: torch.Tensor | None) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """``(fp8, k_scale, v_scale)``: an FP8 cache needs both ``[num_kv_heads]`` float32 scales
    on its device; a 16/32-bit cache takes none (its pointers are then placeholders)."""
    fp8 = k_cache.dtype == FP8_KV
    if not fp8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"KV scales are for an FP8 cache, not {k_cache.dtype}")
        return False, k_cache, k_cache
    heads = k_cache.shape[2]
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is None:
            raise ValueError(f"an FP8 KV cache needs {name}")
        if t.shape != (heads,) or t.dtype != torch.float32 or t.device != k_cache.device \
                or not t.is_contiguous():
            raise ValueError(f"{name} must be [num_kv_heads={heads}] float32 on "
                             f"{k_cache.device}, got {tuple(t.shape)} {t.dtype} on {t.device}")
    return True, k_scale, v_scale  # type: ignore[return-value]


def store_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write each token's K/V into its cache slot (reshape-and-cache); slots < 0 are skipped.
    An FP8 cache (``FP8_KV``) stores ``K / k_scale`` and ``V / v_scale`` (``[num_kv_heads]``
    float32), saturated to +-448.

    key, value: ``[num_tokens, num_kv_heads, head_dim]``, float16/bfloat16/float32 (cast to
    the cache dtype); k_cache, v_cache: ``[num_blocks, chunk_size, num_kv_heads, head_dim]``,
    any strides with a contiguous last dim (e.g. the views ``kv_cache[0]``, ``kv_cache[1]`` of a
    ``[2, num_blocks, chunk_size, num_kv_heads, head_dim]`` tensor); slot_mapping:
    ``[num_tokens]`` int64 (or int32), slot ``= block * chunk_size + offset``.
    """
    _check_float("key", key, 3)
    _check_float("value", value, 3)
    _check_cache_pair(k_cache, v_cache)
    _check_index("slot_mapping", slot_mapping, 1)
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ in shape")
    num_tokens, num_kv_heads, head_dim = key.shape
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"key [num_tokens, num_kv_heads, head_dim] = {tuple(key.shape)} does not match "
            f"cache [num_blocks, chunk_size, num_kv_heads, head_dim] = {tuple(k_cache.shape)}"
        )
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens"
        )
    device = key.device
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("slot_mapping", slot_mapping)):
        _check_device(name, t, device)
    fp8, ks, vs = _kv_scales(k_cache, k_scale, v_scale)
    if num_tokens == 0:
        return
    _k._store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, ks, vs,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads,
        CHUNK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        KV_FP8=fp8,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )


def _attention_tiles(rows: int, mean_rows: float, head_dim: int, is_cuda: bool,
                     long_context: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for ``rows = max_query_len * group`` rows of
    the longest range and ``mean_rows`` per range on average.

    Chosen by measurement (docs/performance.md, "Tile sweep"): where ranges are long on
    average (prefill batches), 128-row query tiles with 32-position KV tiles and two stages
    match FlashAttention; short ranges (decode) also prefer 32-position KV tiles. A batch
    whose longest range is long but whose ranges are mostly short (prefill mixed into decodes)
    would waste most of a 128-row tile on every decode range: it keeps the 64 x 64 tiles,
    which were measured faster there. Short ranges over long contexts (``long_context``: a
    decode step whose longest context reaches ``launch_policy.LONG_DECODE_KV``) take
    128-position KV tiles, 4 warps, 2 stages: the H200 sweep's best at 32k-128k
    (docs/long_context.md). The interpreter (CPU tests) keeps the older tiles, except that
    ``long_context`` takes the same 128-position KV tiles there (so tests cover them)."""
    older = (min(64, max(16, triton.next_power_of_2(rows))),
             64 if head_dim <= 128 or not is_cuda else 32, 4, 3)
    if long_context and rows <= 64 and head_dim <= 128:
        return max(16, triton.next_power_of_2(rows)), 128, 4, 2
    if not is_cuda:
        return older
    if mean_rows >= 128 and head_dim <= 128:
        return 128, 32, 4, 2
    if rows <= 64:
        return max(16, triton.next_power_of_2(rows)), 32, 4, 2
    return older




def attention_tile_choices(head_dim: int, is_cuda: bool) -> set[tuple[int, int, int, int]]:
    """Every tile shape :func:`_attention_tiles` can pick for this head dim."""
    rows = [2**i for i in range(17)]
    return {_attention_tiles(r, m, head_dim, is_cuda, long) for r in rows
            for m in (1, 64, 128, r) if m <= r for long in (False, True)}


ITEM_SPLIT_BITS = 5
"""A work item's low bits hold its KV split (``MAX_SPLITS`` = 32 fits)."""


def work_items_for(query_lens: Sequence[int] | np.ndarray, group: int, block_m: int,
                   starts: Sequence[int] | np.ndarray | None = None, splits: int = 1,
                   span: int = 0, block_n: int = 64) -> np.ndarray:
    """Work items of the static-grid mode, int32 ``range * 65536 + tile * 32 + split``: every
    ``block_m``-row tile of every range (rows = query tokens x ``group`` query heads per KV
    head), in range order. At most ``cdiv(total_tokens * group, block_m) + len(query_lens)``
    items unsplit. With ``splits`` > 1 (and ``starts``, the ranges' first positions, ``span``
    and ``block_n`` as the launch's), each tile comes once per KV split it uses, as the kernel
    cuts its KV (``max(equal part, span)``-position pieces): ``sum(cdiv(kv_len, per_split))``
    items, at most ``sum(kv_len) / span`` more than unsplit."""
    q = np.asarray(query_lens, dtype=np.int64)
    tiles = (q * group + block_m - 1) // block_m
    if len(tiles) and tiles.max() >= 65536 >> ITEM_SPLIT_BITS:
        raise ValueError(f"a range of {int(tiles.max())} tiles: work items hold fewer than "
                         f"{65536 >> ITEM_SPLIT_BITS}")
    firsts = np.cumsum(tiles) - tiles  # each range's first item
    ranges = np.repeat(np.arange(len(tiles), dtype=np.int64), tiles)
    within = np.arange(int(tiles.sum()), dtype=np.int64) - np.repeat(firsts, tiles)
    items = ranges * 65536 + (within << ITEM_SPLIT_BITS)
    if splits > 1:
        if starts is None:
            raise ValueError("split work items need the ranges' starts")
        ql = q[ranges]
        kv = np.asarray(starts, dtype=np.int64)[ranges] + np.minimum(
            ((within + 1) * block_m - 1) // group, ql - 1) + 1
        equal = -(-kv // splits)  # the kernel's equal part, aligned to block_n
        per = np.maximum(-(-equal // block_n) * block_n, span)
        used = np.minimum(-(-kv // per), splits)
        firsts = np.cumsum(used) - used
        items = np.repeat(items, used) + (np.arange(int(used.sum()), dtype=np.int64)
                                          - np.repeat(firsts, used))
    return items.astype(np.int32)


def attention_warmup_plan(num_heads: int, num_kv_heads: int, head_dim: int, is_cuda: bool,
                          spans: bool = True) -> list[tuple[tuple[int, int, int, int], int, bool]]:
    """``(tiles, num_kv_splits, by span)`` of each attention variant an eager step can launch
    for this shape (what :func:`compile_attention_kernels` compiles):

    - a decode launch (``max_query_len`` 1: ``group`` rows) takes the decode tiles, short or
      long context, unsplit, split, or split by span (the only launches outside the CUDA
      graphs' work items that split by span, ``_check_span``);
    - a launch with a prefill range (``max_query_len`` >= 2: more rows, never long context,
      which is a decode launch's class) takes the tiles of its rows, unsplit or split.

    Tiles no launch of this shape picks (e.g. long-context tiles of 32 or 64 rows where a
    decode has 4) are left out. ``spans`` False: no span variants (a 16-bit scratch of an FP8
    cache serves no decode launch)."""
    group = num_heads // num_kv_heads
    decode = {_attention_tiles(group, group, head_dim, is_cuda, long) for long in (False, True)}
    rows = sorted({q * group for q in range(2, 65)} | {2**i for i in range(17) if 2**i > group})
    other = {_attention_tiles(r, m, head_dim, is_cuda) for r in rows
             for m in (group, 64, 128, r) if group <= m <= r}
    plan = [(t, s, False) for t in sorted(decode | other) for s in (1, 2)]
    return plan + [(t, 2, True) for t in sorted(decode)] if spans else plan


def compile_attention_kernels(num_heads: int, num_kv_heads: int, head_dim: int,
                              chunk_size: int, dtype: torch.dtype,
                              device: torch.device, kv_dtype: torch.dtype | None = None,
                              is_cuda: bool | None = None, spans: bool = True) -> int:
    """Compile, before serving, the attention kernel variants a step of this shape can launch
    (:func:`attention_warmup_plan`; the split combiners with them) by running each once on a
    one-token problem. Otherwise Triton compiles a variant the first time a step needs it,
    stalling that step for about a second. ``is_cuda``: whose tile choices (None: the
    device's). Returns the number of variants run."""
    q = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=device)
    cache = torch.zeros(1, chunk_size, num_kv_heads, head_dim, dtype=kv_dtype or dtype,
                        device=device)
    one = None
    if cache.dtype == FP8_KV:
        one = torch.ones(num_kv_heads, dtype=torch.float32, device=device)
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=device)
    args = (q, cache, cache, zero.view(1, 1), qsl, zero, zero, head_dim**-0.5)
    span = torch.full((1,), chunk_size, dtype=torch.int32, device=device)
    if is_cuda is None:
        is_cuda = device.type == "cuda"
    plan = attention_warmup_plan(num_heads, num_kv_heads, head_dim, is_cuda, spans)
    for tiles, splits, by_span in plan:
        paged_attention_triton(*args, max_query_len=1, num_kv_splits=splits, tiles=tiles,
                               kv_split_span=span if by_span else None, k_scale=one,
                               v_scale=one)
    return len(plan)


def attention_choice(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
                     num_ranges: int, max_query_len: int, device: torch.device,
                     long_context: bool = False) -> tuple[tuple[int, int, int, int], int]:
    """The tiles and KV split count :func:`paged_attention_triton` picks itself (given
    neither) for a launch of this shape (what ``benchmarks/long_attention.py`` reports)."""
    group = num_heads // num_kv_heads
    tiles = _attention_tiles(max_query_len * group, num_tokens * group / num_ranges, head_dim,
                             device.type == "cuda", long_context)
    return tiles, launch_kv_splits(tiles[0], num_tokens, num_heads, num_kv_heads, head_dim,
                                   num_ranges, max_query_len, device, long_context)


def _check_attention_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                          range_start_pos: torch.Tensor, range_table: torch.Tensor, scale: float,
                          max_query_len: int, out: torch.Tensor | None,
                          num_kv_splits: int | None, worklist: bool = False) -> torch.Tensor:
    """Raise ValueError unless :func:`paged_attention_triton`'s arguments fit together;
    returns ``out`` (allocated if None)."""
    _check_float("q", q, 3)
    _check_cache_pair(k_cache, v_cache)
    _check_index("block_tables", block_tables, 2)
    _check_index("query_start_loc", query_start_loc, 1)
    _check_index("range_start_pos", range_start_pos, 1)
    _check_index("range_table", range_table, 1)
    num_tokens, num_heads, head_dim = q.shape
    _num_blocks, chunk_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {cache_head_dim}")
    if q.dtype != k_cache.dtype and k_cache.dtype != FP8_KV:
        raise ValueError(f"q dtype {q.dtype} != cache dtype {k_cache.dtype}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    num_ranges = range_start_pos.shape[0]
    if query_start_loc.shape[0] != num_ranges + 1:
        raise ValueError(
            f"query_start_loc has {query_start_loc.shape[0]} entries, expected num_ranges + 1 = "
            f"{num_ranges + 1}"
        )
    if range_table.shape[0] != num_ranges:
        raise ValueError(f"range_table has {range_table.shape[0]} entries for {num_ranges} ranges")
    if not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len must be a non-negative int, got {max_query_len!r}")
    most = _MAX_SPLITS if worklist else _DECODE_MAX_SPLITS
    if num_kv_splits is not None and (
        not isinstance(num_kv_splits, int) or num_kv_splits < 1
        or num_kv_splits & (num_kv_splits - 1) or num_kv_splits > most
    ):
        raise ValueError(f"num_kv_splits must be a power of two in [1, {most}], got "
                         f"{num_kv_splits!r}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        _check_float("out", out, 3)
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(
                f"out is {tuple(out.shape)} {out.dtype}, expected {tuple(q.shape)} {q.dtype}"
            )
    device = q.device
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("block_tables", block_tables), ("query_start_loc", query_start_loc),
                    ("range_start_pos", range_start_pos), ("range_table", range_table),
                    ("out", out)):
        _check_device(name, t, device)
    return out


def _launch_plan(q: torch.Tensor, out: torch.Tensor, num_kv_heads: int, num_ranges: int,
                 max_query_len: int, tiles: tuple[int, int, int, int] | None,
                 num_kv_splits: int | None, work_items: torch.Tensor | None,
                 num_work_items: torch.Tensor | None, kv_split_span: torch.Tensor | None,
                 long_context: bool = False
                 ) -> tuple[tuple[int, int, int, int], int, tuple[torch.Tensor, ...]]:
    """The tiles, the KV split count and the split workspaces (``out`` thrice when unsplit)
    of one :func:`paged_attention_triton` launch."""
    num_tokens, num_heads, head_dim = q.shape
    device = q.device
    group = num_heads // num_kv_heads
    tiles_arg = tiles
    if tiles is None:
        tiles = _attention_tiles(max_query_len * group, num_tokens * group / num_ranges,
                                 head_dim, q.is_cuda, long_context)
    elif (len(tiles) != 4 or any(t < 1 or t & (t - 1) for t in tiles[:3])
          or min(tiles[:2]) < 16 or tiles[3] < 1):
        raise ValueError("tiles must be (BLOCK_M, BLOCK_N, num_warps, num_stages): powers of two, "
                         f"BLOCK_M and BLOCK_N >= 16, num_stages >= 1; got {tiles}")
    worklist = work_items is not None
    if worklist:
        if num_work_items is None or tiles_arg is None:
            raise ValueError("work_items needs num_work_items and the tiles it was cut for")
        _check_index("work_items", work_items, 1)
        _check_index("num_work_items", num_work_items, 1)
        for name, t in (("work_items", work_items), ("num_work_items", num_work_items)):
            _check_device(name, t, device)
        splits = num_kv_splits or 1  # the caller's: the grid must not follow the ranges
        if splits > 1 and kv_split_span is None:
            raise ValueError("work_items with KV splits needs kv_split_span (the split span "
                             "the items were cut for)")
    else:
        splits = num_kv_splits
        if splits is None:
            splits = launch_kv_splits(tiles[0], num_tokens, num_heads, num_kv_heads, head_dim,
                                      num_ranges, max_query_len, device, long_context)
    if splits > 1:
        ws_acc = torch.empty((num_tokens, num_heads, splits, head_dim), dtype=torch.float32,
                             device=device)
        ws_m = torch.empty((num_tokens, num_heads, splits), dtype=torch.float32, device=device)
        ws_l = torch.empty_like(ws_m)
    else:
        ws_acc = ws_m = ws_l = out  # unused
    return tiles, splits, (ws_acc, ws_m, ws_l)


def _check_span(kv_split_span: torch.Tensor | None, max_query_len: int, splits: int,
                device: torch.device, worklist: bool) -> bool:
    """Whether the launch splits by span; raises if it cannot."""
    if kv_split_span is None:
        return False
    if splits < 2 or (max_query_len != 1 and not worklist):
        raise ValueError("kv_split_span is for decode (max_query_len 1) or work items, with "
                         f"num_kv_splits > 1; got max_query_len {max_query_len}, {splits} splits")
    _check_index("kv_split_span", kv_split_span, 1)
    _check_device("kv_split_span", kv_split_span, device)
    return True


def _combine(out: torch.Tensor, ws: tuple[torch.Tensor, ...], query_start_loc: torch.Tensor,
             range_start_pos: torch.Tensor, span_t: torch.Tensor,
             work_items: torch.Tensor | None, num_work: torch.Tensor, max_query_len: int,
             splits: int, group: int, tiles: tuple[int, int, int], span: bool) -> None:
    """Merge a split launch's partials into ``out``: item by item in the static-grid mode
    (``work_items``), else by (range, query token, head)."""
    num_heads, head_dim = out.shape[1], out.shape[2]
    block_m, block_n, num_warps = tiles
    if work_items is not None:
        _k._combine_items_kernel[(work_items.shape[0], 1, num_heads // group)](
            out, *ws, query_start_loc, range_start_pos, work_items, num_work, span_t,
            out.stride(0), out.stride(1), num_heads, splits, GROUP=group, HEAD_DIM=head_dim,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        )
        return
    _k._combine_splits_kernel[(len(range_start_pos), max_query_len, num_heads)](
        out, *ws, query_start_loc, range_start_pos, span_t, out.stride(0),
        out.stride(1), num_heads, splits, HEAD_DIM=head_dim, BLOCK_S=_MAX_SPLITS,
        BLOCK_N=block_n, SPAN=span, num_warps=4,  # BLOCK_S: splits merged at a time
    )


def _exact_dots(q: torch.Tensor) -> bool:
    """Whether the attention kernel computes its dots in float32 (``FP32``): for float32
    queries, and for bf16 under Triton's interpreter, whose ``tl.dot`` reads bf16 as raw
    uint16 (upcast there instead)."""
    return q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and not q.is_cuda)


def _fp8_queries(q: torch.Tensor, cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_dot``'s queries: ``q`` ``[T, H, D]`` as e4m3 ``[T, H, D]``, each (token, head)
    row divided by its scale ``[T, H]`` float32 (its largest magnitude over 448, so that the
    row spans e4m3's range). Raises ValueError unless the cache is FP8."""
    if cache_dtype != FP8_KV:
        raise ValueError(f"fp8_dot is for an FP8 cache, not {cache_dtype}")
    q32 = q.float()
    scale = (q32.abs().amax(-1) / 448.0).clamp_min(1e-30)
    return (q32 / scale[..., None]).to(FP8_KV), scale.contiguous()


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    range_start_pos: torch.Tensor,
    range_table: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    *,
    num_kv_splits: int | None = None,
    tiles: tuple[int, int, int, int] | None = None,
    work_items: torch.Tensor | None = None,
    num_work_items: torch.Tensor | None = None,
    kv_split_span: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    long_context: bool = False, fp8_dot: bool = False,
) -> torch.Tensor:
    """Causal attention of ragged query ranges over the paged KV cache.

    q: ``[num_tokens, num_heads, head_dim]`` (float16/bfloat16/float32, last dim contiguous);
    k_cache, v_cache: ``[num_blocks, chunk_size, num_kv_heads, head_dim]``, same dtype as q,
    any strides with a contiguous last dim; ``num_heads`` a multiple of ``num_kv_heads``,
    ``head_dim`` a power of two >= 16. block_tables: ``[num_tables, max_blocks]`` int32 (or
    int64) block ids, row-contiguous; query_start_loc: ``[num_ranges + 1]`` int32 cumulative
    token offsets into q; range_start_pos: ``[num_ranges]`` int32 position of each range's
    first token; range_table: ``[num_ranges]`` int32 row of block_tables each range reads
    (may be shared). Token ``i`` of range ``r`` sits at position ``p = range_start_pos[r] +
    i`` and attends to positions ``0..p``. max_query_len: host int, at least the longest
    range (it sizes the grid). out: optional ``[num_tokens, num_heads, head_dim]`` of q's
    dtype; tokens outside every range are not written. num_kv_splits: split each KV range
    over this many programs (a power of two, at most 128, 32 with work items; 1 = off) and
    merge the partials in a second kernel; ``None``: ``launch_policy.auto_kv_splits``. tiles:
    ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` (tuning). work_items, num_work_items: the
    static-grid mode of CUDA graphs (:func:`work_items_for`): ``[max_items]`` int32 ``range *
    65536 + row tile * 32 + KV split`` and ``[1]`` int32 count; needs ``tiles`` (and with
    splits the span) the items were cut for; the grid is ``max_items`` whatever the ranges.
    kv_split_span: decode or work items, with splits: ``[1]`` int32, the fewest positions a
    split covers (``launch_policy``). k_scale, v_scale: an FP8 cache's ``[num_kv_heads]``
    float32 scales. long_context: ``launch_policy.is_long_decode`` of the step: short ranges
    take 128-position KV tiles, automatic splits go up to 128. fp8_dot: an FP8 cache's two
    products take e4m3 operands (:func:`_fp8_queries`; ``FP8_DOT``). Returns out.
    """
    out = _check_attention_args(q, k_cache, v_cache, block_tables, query_start_loc,
                                range_start_pos, range_table, scale, max_query_len, out,
                                num_kv_splits, work_items is not None)
    fp8, ks, vs = _kv_scales(k_cache, k_scale, v_scale)
    q_in, q_scale = _fp8_queries(q, k_cache.dtype) if fp8_dot else (q, query_start_loc)
    num_tokens, num_heads, head_dim = q.shape
    chunk_size, num_kv_heads, num_ranges = k_cache.shape[1], k_cache.shape[2], len(range_start_pos)
    if num_tokens == 0 or num_ranges == 0 or max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    (block_m, block_n, num_warps, num_stages), splits, (ws_acc, ws_m, ws_l) = _launch_plan(
        q, out, num_kv_heads, num_ranges, max_query_len, tiles, num_kv_splits, work_items,
        num_work_items, kv_split_span, long_context)
    worklist = work_items is not None
    span = _check_span(kv_split_span, max_query_len, splits, q.device, worklist)
    grid = ((work_items.shape[0], 1, num_kv_heads) if worklist else
            (num_ranges, triton.cdiv(max_query_len * group, block_m) * splits, num_kv_heads))
    unused = query_start_loc  # stands in for the pointers a mode does not read
    work, num_work = (work_items, num_work_items) if worklist else (unused, unused)
    span_t = kv_split_span if span else unused
    _k._paged_attention_kernel[grid](
        q_in, k_cache, v_cache, out, block_tables, query_start_loc, range_start_pos,
        range_table, ks, vs, q_scale, float(scale) * _LOG2E,
        q_in.stride(0), q_in.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3],
        *v_cache.stride()[:3], block_tables.stride(0),
        ws_acc, ws_m, ws_l, num_heads, splits, work, num_work, span_t,
        GROUP=group, CHUNK_SIZE=chunk_size, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        FP32=_exact_dots(q), SPLIT=splits > 1, WORKLIST=worklist, SPAN=span, KV_FP8=fp8,
        FP8_DOT=fp8_dot, num_warps=num_warps, num_stages=num_stages,
    )
    if splits > 1:
        _combine(out, (ws_acc, ws_m, ws_l), query_start_loc, range_start_pos, span_t,
                 work_items if worklist else None, num_work, max_query_len, splits, group,
                 (block_m, block_n, num_warps), span)
    return out
