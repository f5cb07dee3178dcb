"""FP8 prefill through a 16-bit scratch: plan (host), rule, dequantize and attend (device).

The attention kernel over an FP8 cache upcasts each e4m3 K/V tile to fp16 in registers
before ``tl.dot``; on Hopper that costs prefill (many query rows per KV position) about 30%
against the 16-bit kernel (docs/long_context.md). A prefill-heavy launch therefore first
dequantizes the KV blocks its ranges read into a 16-bit scratch, then runs the 16-bit kernel
on it::

    cache (FP8)  block table row b: [7][2][9][4]...        scale per KV head
                        | dequantize (triton_dequant), K and V
    scratch (q's dtype) rows laid end to end: [b: 0 1 2 3 ...][b': 4 5 ...]
    scratch table row u (the u-th row read) = offset[u] + arange(blocks[u])

Only the blocks the launch's ranges can see are copied: row ``b`` needs ``cdiv(max over its
ranges of start_pos + query_len, chunk_size)`` blocks; the scratch's block tables have one
row per row read, and a range table of their own. The plan is built on the host from
the step's host arrays (no device sync) by :func:`plan_fp8_scratch`, which also applies the
cost rule (:func:`scratch_pays`) and the size cap (:data:`SCRATCH_CAP_BYTES`); it returns
None where the launch should read FP8 directly. Decode launches, CUDA-graph launches and
chunk sizes that are not powers of two always read FP8 directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pensieve.config import FP8_SCRATCH_BYTES
from pensieve.kernels import triton_dequant as _k
from pensieve.kernels.launch import FP8_KV, _check_device, _check_index, _kv_scales

SCRATCH_CAP_BYTES = FP8_SCRATCH_BYTES
"""The largest scratch (K and V, 16 bits) a launch allocates; above it the launch reads FP8
directly (``config.FP8_SCRATCH_BYTES``, which the engine reserves beside its activations)."""
SCRATCH_MIN_ROWS = 1024
"""The scratch pays when each dequantized KV position is attended by at least this many
query rows (query tokens x GQA group) on average. Derivation (H200 figures, not tuned by
measurement): the direct FP8 kernel costs ~25% more than the 16-bit one where compute-bound
(1.27-1.34x against 1.02-1.10x of SDPA, docs/long_context.md), i.e. ~0.25 x 2 flops per KV
element per row at ~700 TFLOP/s; the dequantization moves 3 bytes per KV element at
~3.5 TB/s. Break-even: 3 x 700e12 / (0.5 x 3.5e12) = 1,200 rows."""


@dataclass
class Fp8Scratch:
    """One launch's scratch plan (``AttentionMetadata.fp8_scratch``), built once per step and
    reused by every layer. Its block tables have one row per block-table row the launch
    reads, in row order, so it has a range table of its own."""

    num_blocks: int
    """Scratch blocks (host int: sizes the scratch without a device sync)."""
    src_blocks: torch.Tensor
    """``[num_blocks]`` int32: the cache block each scratch block copies."""
    block_tables: torch.Tensor
    """``[U, max_blocks]`` int32, ``U`` the rows the launch reads: row ``u`` ``offset[u] +
    arange(blocks[u])`` (then zeros)."""
    range_table: torch.Tensor
    """``[R]`` int32: each range's row of :attr:`block_tables`."""


def scratch_blocks(starts: np.ndarray, qlens: np.ndarray, rows: np.ndarray,
                   chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(used, inv, need)`` of ranges ``(starts, qlens)`` reading block-table rows ``rows``:
    the rows read (sorted), each range's index into them, and per used row the blocks its
    ranges can see (``cdiv(max end, chunk)``)."""
    used, inv = np.unique(np.asarray(rows, np.int64), return_inverse=True)
    need = np.zeros(len(used), dtype=np.int64)
    ends = np.asarray(starts, np.int64) + np.asarray(qlens, np.int64)
    np.maximum.at(need, inv, -(-ends // chunk))
    return used, inv, need


def scratch_pays(starts: np.ndarray, qlens: np.ndarray, blocks: np.ndarray, chunk: int,
                 group: int, min_rows: int = SCRATCH_MIN_ROWS) -> bool:
    """The cost rule: query rows x the KV positions they attend (causal, summed over ranges)
    against ``min_rows`` x the KV positions dequantized (``blocks`` x ``chunk``)."""
    s = np.asarray(starts, np.int64)
    q = np.asarray(qlens, np.int64)
    attended = int((q * s + q * (q + 1) // 2).sum()) * group
    positions = int(np.asarray(blocks).sum()) * chunk
    return positions > 0 and attended >= min_rows * positions


def scratch_bytes(num_blocks: int, chunk: int, num_kv_heads: int, head_dim: int,
                  elem_bytes: int) -> int:
    """Bytes of a scratch of ``num_blocks`` blocks, K and V."""
    return 2 * num_blocks * chunk * num_kv_heads * head_dim * elem_bytes


def plan_fp8_scratch(starts: np.ndarray, qlens: np.ndarray, rows: np.ndarray,
                     tables: np.ndarray, chunk: int, num_heads: int, num_kv_heads: int,
                     head_dim: int, elem_bytes: int, device: torch.device,
                     cap_bytes: int | None = None,
                     min_rows: int | None = None) -> Fp8Scratch | None:
    """The scratch plan of a launch over an FP8 cache, or None where it should read FP8
    directly: the rule (:func:`scratch_pays`) says no, the scratch would exceed
    ``cap_bytes`` (None: :data:`SCRATCH_CAP_BYTES`), or ``chunk`` is not a power of two
    (``min_rows`` None: :data:`SCRATCH_MIN_ROWS`). ``starts``, ``qlens``, ``rows``: per
    range of the launch, its first position, query tokens and block-table row; ``tables``:
    the host block tables ``[B, max_blocks]``; ``elem_bytes``: the scratch dtype's (q's)."""
    if chunk & (chunk - 1) or len(qlens) == 0:
        return None
    used, inv, need = scratch_blocks(starts, qlens, rows, chunk)
    total = int(need.sum())
    cap = SCRATCH_CAP_BYTES if cap_bytes is None else cap_bytes
    if scratch_bytes(total, chunk, num_kv_heads, head_dim, elem_bytes) > cap:
        return None
    rows_min = SCRATCH_MIN_ROWS if min_rows is None else min_rows
    if not scratch_pays(starts, qlens, need, chunk, num_heads // num_kv_heads, rows_min):
        return None
    offsets = np.cumsum(need) - need
    width = max(1, int(need.max()))
    within = np.arange(width, dtype=np.int64)
    scratch_tables = np.where(within[None, :] < need[:, None], offsets[:, None] + within, 0)
    src = tables[np.repeat(used, need), np.arange(total, dtype=np.int64) - np.repeat(offsets, need)]
    host = torch.empty(total + scratch_tables.size + len(inv), dtype=torch.int32,
                       pin_memory=device.type == "cuda")
    host.numpy()[...] = np.concatenate((src, scratch_tables.ravel(), inv))
    dev = host.to(device, non_blocking=True)  # one copy
    return Fp8Scratch(num_blocks=total, src_blocks=dev[:total],
                      block_tables=dev[total : total + scratch_tables.size].view(len(used), width),
                      range_table=dev[total + scratch_tables.size :])


def dequant_blocks_triton(k_cache: torch.Tensor, v_cache: torch.Tensor,
                          src_blocks: torch.Tensor, num_blocks: int, k_scale: torch.Tensor,
                          v_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[2, num_blocks, chunk_size, num_kv_heads, head_dim]`` of ``dtype``: K then V of cache
    blocks ``src_blocks`` (``[num_blocks]`` int32, values trusted) times their per-head
    scales (``[num_kv_heads]`` float32). k_cache, v_cache: FP8 ``[num_cache_blocks,
    chunk_size, num_kv_heads, head_dim]``, contiguous last dim, chunk_size a power of two."""
    if k_cache.dtype != FP8_KV:
        raise ValueError(f"the scratch dequantizes an FP8 cache, not {k_cache.dtype}")
    _, ks, vs = _kv_scales(k_cache, k_scale, v_scale)
    if k_cache.shape != v_cache.shape or v_cache.dtype != FP8_KV:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                         f"{v_cache.dtype} differ")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches need a contiguous last dim")
    _, chunk, hkv, head_dim = k_cache.shape
    if chunk & (chunk - 1) or head_dim & (head_dim - 1):
        raise ValueError(f"chunk_size {chunk} and head_dim {head_dim} must be powers of two")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"scratch dtype must be 16 or 32-bit float, got {dtype}")
    _check_index("src_blocks", src_blocks, 1)
    if src_blocks.shape[0] != num_blocks:
        raise ValueError(f"src_blocks has {src_blocks.shape[0]} entries for {num_blocks} blocks")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("src_blocks", src_blocks)):
        _check_device(name, t, k_cache.device)
    scratch = torch.empty((2, num_blocks, chunk, hkv, head_dim), dtype=dtype,
                          device=k_cache.device)
    if num_blocks == 0:
        return scratch
    _k._dequant_blocks_kernel[(num_blocks, hkv, 2)](
        k_cache, v_cache, scratch, src_blocks, ks, vs, *k_cache.stride()[:3],
        *v_cache.stride()[:3], num_blocks, hkv, CHUNK_SIZE=chunk, HEAD_DIM=head_dim,
        num_warps=4 if chunk * head_dim >= 2048 else 1,
    )
    return scratch


def paged_attention_fp8_scratch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: Fp8Scratch,
    query_start_loc: torch.Tensor, range_start_pos: torch.Tensor, scale: float,
    max_query_len: int, out: torch.Tensor | None = None, *,
    k_scale: torch.Tensor, v_scale: torch.Tensor,
    tiles: tuple[int, int, int, int] | None = None, num_kv_splits: int | None = None,
    kv_split_span: torch.Tensor | None = None, long_context: bool = False,
) -> torch.Tensor:
    """:func:`launch.paged_attention_triton` of the ranges over an FP8 cache, computed by the
    16-bit kernel over a scratch of ``plan`` (:func:`dequant_blocks_triton` into q's dtype);
    same arguments and result, ``plan.block_tables`` and ``plan.range_table`` in place of the
    cache's block tables and the launch's range table. ``tiles``,
    ``num_kv_splits``, ``kv_split_span``, ``long_context``: as the launcher's (None: it
    chooses as for a 16-bit cache)."""
    from pensieve.kernels.launch import paged_attention_triton

    scratch = dequant_blocks_triton(k_cache, v_cache, plan.src_blocks, plan.num_blocks,
                                    k_scale, v_scale, q.dtype)
    return paged_attention_triton(q, scratch[0], scratch[1], plan.block_tables,
                                  query_start_loc, range_start_pos, plan.range_table, scale,
                                  max_query_len=max_query_len, out=out, tiles=tiles,
                                  num_kv_splits=num_kv_splits, kv_split_span=kv_split_span,
                                  long_context=long_context)


def compile_fp8_scratch(num_kv_heads: int, head_dim: int, chunk_size: int, dtype: torch.dtype,
                        device: torch.device) -> int:
    """Compile the dequantization kernel before serving (one block); returns 1, or 0 where
    ``chunk_size`` is not a power of two (the scratch is never planned then)."""
    if chunk_size & (chunk_size - 1):
        return 0
    cache = torch.zeros(1, chunk_size, num_kv_heads, head_dim, dtype=FP8_KV, device=device)
    one = torch.ones(num_kv_heads, dtype=torch.float32, device=device)
    src = torch.zeros(1, dtype=torch.int32, device=device)
    dequant_blocks_triton(cache, cache, src, 1, one, one, dtype)
    return 1
