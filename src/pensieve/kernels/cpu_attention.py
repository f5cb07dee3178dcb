"""Paged attention through PyTorch's fused CPU attention: the engine's attention off CUDA.

Same arguments and result as :func:`pensieve.kernels.reference.paged_attention_ref` (the
tests' exact float32 oracle), but each query range's keys are read once per layer
(:func:`pensieve.kernels.reference.read_kv`) and attended by the flash kernel of
``scaled_dot_product_attention``, which never materialises the ``[query_len, context_len]``
scores. A range of ``L`` tokens whose first token sits at position ``s`` reads two key sets::

    keys      [ prefix: 0 .. s-1 ][ diagonal: s .. s+L-1 ]
    query i   sees all of it      sees 0 .. i of it (causal, top-left aligned)

SDPA's own causal mask is top-left aligned, so it fits the diagonal only (and the whole range
when ``s = 0``). The prefix is attended without a mask; both parts come with their
log-sum-exp, and softmax over the union of two key sets is their LSE-weighted mean, which is
exact. The prefix call folds the query heads that share a KV head into the query length
(``[Hkv, group * L, Dh]``), so the long prefix K/V are never repeated per query head; the
diagonal (``L`` keys) repeats them. Without the CPU flash op (the one call that returns the
LSE), a range with a prefix falls back to a boolean mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pensieve.kernels.reference import range_kv

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def paged_attention_cpu(
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
    """Causal attention of ragged query ranges over paged KV; see
    :func:`~pensieve.kernels.reference.paged_attention_ref` for the arguments and shapes
    (``k_scale``, ``v_scale``: an FP8 cache's per-head scales).

    Computes in ``q``'s dtype (float32 on the default CPU path); returns
    ``[num_tokens, num_heads, head_dim]`` (``out`` if given; rows of empty ranges untouched).
    """
    if out is None:
        out = torch.empty_like(q)
    for q_lo, q_hi, _, k, v in range_kv(k_cache, v_cache, block_tables, query_start_loc,
                                        range_start_pos, range_table, q.dtype, k_scale,
                                        v_scale):
        out[q_lo:q_hi] = attend_range(q[q_lo:q_hi], k, v, scale)
    return out


def attend_range(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One range's causal attention: q ``[L, H, Dh]`` at positions ``ctx - L .. ctx - 1``
    over k, v ``[ctx, Hkv, Dh]`` (positions ``0 .. ctx - 1``) -> ``[L, H, Dh]``."""
    n, num_heads, head_dim = q.shape
    ctx, num_kv_heads = k.shape[:2]
    group = num_heads // num_kv_heads
    start = ctx - n
    qh = q.transpose(0, 1)  # [H, L, Dh]
    kh, vh = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, ctx, Dh]
    if n == 1:  # a decode: every cached position, no mask
        o = F.scaled_dot_product_attention(  # [1, Hkv, group, Dh]
            qh.reshape(1, num_kv_heads, group, head_dim), kh[None], vh[None], scale=scale)
        return o.reshape(1, num_heads, head_dim)
    kd = kh[:, start:].repeat_interleave(group, dim=0)  # [H, L, Dh]
    vd = vh[:, start:].repeat_interleave(group, dim=0)
    if start == 0:
        o = F.scaled_dot_product_attention(qh[None], kd[None], vd[None], is_causal=True,
                                           scale=scale)  # [1, H, L, Dh]
        return o[0].transpose(0, 1)
    if _FLASH_CPU is None or q.device.type != "cpu":
        return _attend_masked(qh, kh, vh, start, scale).transpose(0, 1)
    o_diag, lse_diag = _FLASH_CPU(qh[None], kd[None], vd[None], is_causal=True, scale=scale)
    qf = qh.reshape(1, num_kv_heads, group * n, head_dim)  # heads of a KV head, one after another
    o_pre, lse_pre = _FLASH_CPU(qf, kh[None, :, :start], vh[None, :, :start], scale=scale)
    o_pre = o_pre.reshape(num_heads, n, head_dim)
    lse_pre, lse_diag = lse_pre.reshape(num_heads, n, 1), lse_diag.reshape(num_heads, n, 1)
    top = torch.maximum(lse_pre, lse_diag)
    w_pre, w_diag = (lse_pre - top).exp_(), (lse_diag - top).exp_()  # [H, L, 1] float32
    o = o_pre * w_pre + o_diag[0] * w_diag  # [H, L, Dh]
    return (o / (w_pre + w_diag)).to(q.dtype).transpose(0, 1)


def _attend_masked(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, start: int,
                   scale: float) -> torch.Tensor:
    """qh ``[H, L, Dh]`` at positions ``start ..`` over kh, vh ``[Hkv, ctx, Dh]`` with an
    explicit causal mask (bottom-right aligned) -> ``[H, L, Dh]``."""
    group = qh.shape[0] // kh.shape[0]
    ctx = kh.shape[1]
    q_pos = torch.arange(start, ctx, device=qh.device)[:, None]
    mask = torch.arange(ctx, device=qh.device)[None, :] <= q_pos  # [L, ctx]
    return F.scaled_dot_product_attention(  # 4-D: the fused kernels take no 3-D inputs
        qh[None], kh.repeat_interleave(group, dim=0)[None],
        vh.repeat_interleave(group, dim=0)[None], attn_mask=mask, scale=scale)[0]
