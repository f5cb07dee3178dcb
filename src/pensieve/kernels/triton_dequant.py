"""Triton kernel of the FP8 prefill scratch: dequantize FP8 KV cache blocks into 16 bits.

Raw ``@triton.jit`` code only; :mod:`pensieve.kernels.fp8_scratch` plans and launches it.
Cache layout as :mod:`pensieve.kernels.triton_attention` (``[num_blocks, chunk_size,
num_kv_heads, head_dim]``, any strides with a contiguous last dim); the scratch is
contiguous ``[2, num_scratch_blocks, chunk_size, num_kv_heads, head_dim]`` (K then V).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dequant_blocks_kernel(
    k_cache_ptr,
    v_cache_ptr,
    scratch_ptr,
    src_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kc_b,
    stride_kc_c,
    stride_kc_h,
    stride_vc_b,
    stride_vc_c,
    stride_vc_h,
    num_scratch,
    num_kv_heads,
    CHUNK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Program ``(j, kv_head, kv)``: ``scratch[kv, j, :, kv_head] = cache[src[j], :, kv_head]
    * scale[kv_head]`` for ``kv`` 0 (K, ``k_scale``) and 1 (V, ``v_scale``), cast to the
    scratch dtype. ``src``: ``[num_scratch]`` int32 cache block ids."""
    j = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    is_v = tl.program_id(2)
    block = tl.load(src_ptr + j).to(tl.int64)
    c = tl.arange(0, CHUNK_SIZE).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    if is_v == 0:
        x = tl.load(k_cache_ptr + block * stride_kc_b + c[:, None] * stride_kc_c
                    + kv_head * stride_kc_h + d[None, :])
        s = tl.load(k_scale_ptr + kv_head)
    else:
        x = tl.load(v_cache_ptr + block * stride_vc_b + c[:, None] * stride_vc_c
                    + kv_head * stride_vc_h + d[None, :])
        s = tl.load(v_scale_ptr + kv_head)
    y = x.to(tl.float32) * s
    row = ((is_v * num_scratch + j) * CHUNK_SIZE + c) * num_kv_heads + kv_head
    tl.store(scratch_ptr + row[:, None] * HEAD_DIM + d[None, :],
             y.to(scratch_ptr.dtype.element_ty))
