"""Triton kernel of the swapper: whole KV blocks gathered and scattered between two tiers.

Raw ``@triton.jit`` kernel only; :mod:`pensieve.kernels.launch_swap` validates and launches
it, :func:`pensieve.kernels.reference.swap_blocks_ref` holds the pure-torch semantics.

One launch copies, for every (src block, dst block) pair of a list, every layer of a layer
range and both K and V: ``num_pairs * num_layers * 2`` *items* of one block each (chunk_size
x num_kv_heads x head_dim elements, contiguous on both sides). Either side may be pinned host
memory that the GPU reads or writes directly through its device-mapped address (zero-copy
over PCIe), so one launch replaces one ``cudaMemcpy`` per run of consecutive CPU blocks.

The grid is *persistent*: a bounded number of programs, each looping over items
``pid, pid + num_programs, ...``, so a copy running on a side stream occupies at most that
many SMs and leaves the rest to the compute kernels. The kernel copies raw words (the
launcher reinterprets the data as the widest integer that divides the block and its
strides), so it is dtype-agnostic and bit-exact; with 8-byte words and aligned bases and
strides each thread moves 16-byte vectors.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_pairs", "num_layers"])
def _swap_blocks_kernel(
    src_ptr,
    dst_ptr,
    pairs_ptr,
    num_pairs,
    num_layers,
    src_stride_layer,
    src_stride_kv,
    src_stride_block,
    dst_stride_layer,
    dst_stride_kv,
    dst_stride_block,
    BLOCK_WORDS: tl.constexpr,
    TILE: tl.constexpr,
):
    """``dst[l, kv, d] = src[l, kv, s]`` for each pair ``(s, d)`` of ``pairs [num_pairs, 2]``
    (int64), each layer ``l < num_layers`` and ``kv`` in (0, 1). Strides are in words; a block
    is ``BLOCK_WORDS`` contiguous words, copied ``TILE`` words at a time. Item ``i`` is pair
    ``i // (2 * num_layers)``, layer ``(i // 2) % num_layers``, K/V ``i % 2``."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    total = num_pairs * num_layers * 2
    lanes = tl.arange(0, TILE)
    for item in range(pid, total, nprog):
        kv = item % 2
        rest = item // 2
        layer = (rest % num_layers).to(tl.int64)
        pair = (rest // num_layers).to(tl.int64)
        s = tl.load(pairs_ptr + 2 * pair)
        d = tl.load(pairs_ptr + 2 * pair + 1)
        src = src_ptr + layer * src_stride_layer + kv * src_stride_kv + s * src_stride_block
        dst = dst_ptr + layer * dst_stride_layer + kv * dst_stride_kv + d * dst_stride_block
        for off in range(0, BLOCK_WORDS, TILE):
            idx = tl.max_contiguous(tl.multiple_of(off + lanes, TILE), TILE)
            if BLOCK_WORDS % TILE == 0:
                x = tl.load(src + idx, eviction_policy="evict_first")
                tl.store(dst + idx, x, eviction_policy="evict_first")
            else:
                mask = idx < BLOCK_WORDS
                x = tl.load(src + idx, mask=mask, eviction_policy="evict_first")
                tl.store(dst + idx, x, mask=mask, eviction_policy="evict_first")
