"""Paged attention as a model layer, and the per-step metadata it reads.

The runner builds one :class:`AttentionMetadata` per step (all tensors on the model's device)
and passes it explicitly into ``model.forward``; every layer reuses it. KV caches are one
tensor per layer, ``[2, num_blocks, chunk_size, num_kv_heads, head_dim]`` (K then V).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from pensieve.kernels import paged_attention, store_kv

if TYPE_CHECKING:
    from pensieve.kernels.fp8_scratch import Fp8Scratch


@dataclass
class AttentionMetadata:
    """Where each token of the flattened batch reads and writes KV.

    Shapes: ``T`` tokens in the step, ``R`` query ranges, ``B`` block tables.
    """

    slot_mapping: torch.Tensor
    """``[T]`` int64: cache slot each token's K/V is written to."""
    query_start_loc: torch.Tensor
    """``[R + 1]`` int32: range ``r`` owns tokens ``query_start_loc[r]:query_start_loc[r+1]``."""
    range_start_pos: torch.Tensor
    """``[R]`` int32: position of each range's first token."""
    range_table: torch.Tensor
    """``[R]`` int32: row of ``block_tables`` each range attends through."""
    block_tables: torch.Tensor
    """``[B, max_blocks]`` int32 block ids (padding entries are never read)."""
    max_query_len: int
    """Longest range in the step (host int: sizes the kernel grid)."""
    layer_ready: Callable[[int], None] | None = None
    """Called with the layer index before the layer touches its KV cache: the runner makes the
    compute stream wait there for that layer's swap-in (pipelined swap-in)."""
    work_items: torch.Tensor | None = None
    """Static-grid attention (steps replayed from CUDA graphs with ranges that vary): ``[W]``
    int32 work items, see :func:`pensieve.kernels.launch.work_items_for`; None: grid from
    ``max_query_len``."""
    num_work_items: torch.Tensor | None = None
    """``[1]`` int32: how many of ``work_items`` are real."""
    tiles: tuple[int, int, int, int] | None = None
    """The attention tiles ``work_items`` were cut for (None: the launcher chooses)."""
    num_kv_splits: int | None = None
    """KV splits of a decode step (None: the launcher chooses from the grid)."""
    kv_split_span: torch.Tensor | None = None
    """``[1]`` int32: a decode step's split span, with ``num_kv_splits``
    (:func:`pensieve.kernels.launch_policy.decode_split_span`). None: equal parts."""
    long_context: bool = False
    """The step's (or, for ``decode``, its decodes') longest context reaches
    ``launch_policy.LONG_DECODE_KV``: decode launches take 128-position KV tiles and up to 128
    KV splits (:func:`pensieve.kernels.launch.paged_attention_triton`)."""
    decode: AttentionMetadata | None = None
    """The step's one-token ranges when they attend in a decode launch of their own
    (``launch_policy.MIXED_DECODES`` ``split``): their ``query_start_loc``, ``range_start_pos``,
    ``range_table`` (offsets into the same tokens), ``max_query_len`` 1 and KV splits; the
    fields above then cover the other ranges only. ``slot_mapping`` and ``block_tables`` are
    the step's."""
    fp8_scratch: Fp8Scratch | None = None
    """An FP8 cache's prefill-heavy launch (the fields above, not ``decode``): the blocks to
    dequantize into a 16-bit scratch that the 16-bit kernel reads
    (:func:`pensieve.kernels.fp8_scratch.plan_fp8_scratch`); None: read FP8 directly."""


class PagedAttention(nn.Module):
    """Store this step's K/V into the paged cache, then attend causally through block tables."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = -1
        """Index of the decoder layer; set by :func:`number_attention_layers`."""
        self.kv_scale: torch.Tensor | None = None
        """``[2, num_kv_heads]`` float32 on the model's device: the K and V scales of an FP8
        KV cache (it stores K / k_scale, V / v_scale); set by :func:`init_kv_scales`, None
        for a 16/32-bit cache."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q: ``[T, H*D]``, k/v: ``[T, Hkv*D]``, kv_cache: ``[2, N, C, Hkv, D]`` -> ``[T, H*D]``."""
        n = q.shape[0]
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if meta.layer_ready is not None:
            meta.layer_ready(self.layer_idx)
        sc = self.kv_scale
        ks, vs = (sc[0], sc[1]) if sc is not None else (None, None)
        store_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping, ks, vs)
        out = None
        dec = meta.decode
        if dec is not None:  # the decodes first, into the rows they own
            out = paged_attention(
                q, kv_cache[0], kv_cache[1], meta.block_tables, dec.query_start_loc,
                dec.range_start_pos, dec.range_table, self.scale, max_query_len=1,
                num_kv_splits=dec.num_kv_splits, kv_split_span=dec.kv_split_span,
                k_scale=ks, v_scale=vs, long_context=dec.long_context,
            )
        out = paged_attention(
            q, kv_cache[0], kv_cache[1], meta.block_tables, meta.query_start_loc,
            meta.range_start_pos, meta.range_table, self.scale, max_query_len=meta.max_query_len,
            out=out, work_items=meta.work_items, num_work_items=meta.num_work_items,
            tiles=meta.tiles, num_kv_splits=meta.num_kv_splits, kv_split_span=meta.kv_split_span,
            k_scale=ks, v_scale=vs, long_context=meta.long_context,
            fp8_scratch=meta.fp8_scratch if sc is not None else None,
        )
        return out.reshape(n, self.num_heads * self.head_dim)


def first_attention(model: nn.Module) -> PagedAttention | None:
    """The model's first :class:`PagedAttention` (they all share heads and head dim)."""
    return next((m for m in model.modules() if isinstance(m, PagedAttention)), None)


def init_kv_scales(model: nn.Module, device: torch.device,
                   scales: dict[int, torch.Tensor] | None = None) -> None:
    """Give every layer the K and V scales of an FP8 KV cache: ``scales[layer]`` ``[2,
    num_kv_heads]`` where given (e.g. a checkpoint's calibrated ``k_scale`` / ``v_scale``),
    else 1 for every head (vLLM's default without calibrated scales). e4m3 keeps 3 mantissa
    bits at any magnitude from 2**-6 to 448, so a scale of 1 loses precision only on K/V
    values beyond 448 (saturated) or below 2**-6 (subnormal)."""
    for m in model.modules():
        if isinstance(m, PagedAttention):
            s = (scales or {}).get(m.layer_idx)
            if s is None:
                s = torch.ones(2, m.num_kv_heads)
            if tuple(s.shape) != (2, m.num_kv_heads):
                raise ValueError(f"layer {m.layer_idx}: KV scales must be [2, "
                                 f"{m.num_kv_heads}], got {tuple(s.shape)}")
            m.kv_scale = s.to(device=device, dtype=torch.float32).contiguous()


def number_attention_layers(model: nn.Module) -> int:
    """Give each PagedAttention its layer index (module order is layer order); returns count."""
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    for i, m in enumerate(layers):
        m.layer_idx = i
    return len(layers)
