"""The attention variants ``benchmarks/kernel_compare.py`` times against one another,
each prepared for a problem as parts to run: ours (one paged launch), SDPA on contiguous KV
(a), gather then SDPA (b), one single-token paged launch per query index (c) and
FlexAttention over the paged cache (d)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from kernel_configs import (
    GroupView,
    Problem,
)
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from pensieve.kernels.launch import paged_attention_triton

# ---------------------------------------------------------------------------------------
# variants: each is a list of parts; a part's run() is the timed work, collect() turns its
# result into [n, H, D] rows of the output at part.tokens (untimed)


@dataclass
class Part:
    run: Callable[[], torch.Tensor]
    collect: Callable[[torch.Tensor], torch.Tensor]
    tokens: slice | torch.Tensor


@dataclass
class Prepared:
    parts: list[Part]
    backend: str = ""


def prepare_ours(p: Problem) -> Prepared:
    out = torch.empty_like(p.q)

    def run() -> torch.Tensor:
        return paged_attention_triton(
            p.q, p.k_cache, p.v_cache, p.block_tables, p.query_start_loc, p.range_start_pos,
            p.range_table, p.scale, p.max_query_len, out=out)

    return Prepared([Part(run, lambda o: o, slice(0, p.num_tokens))], "triton")


@dataclass(frozen=True)
class SdpaCandidate:
    name: str
    backend: SDPBackend
    native_gqa: bool  # False: KV heads are expanded to the query heads first


def sdpa_candidates(device_type: str) -> list[SdpaCandidate]:
    """Backends to try, best first: the first that runs a configuration is used for it."""
    if device_type == "cuda":
        return [SdpaCandidate("flash", SDPBackend.FLASH_ATTENTION, True),
                SdpaCandidate("efficient", SDPBackend.EFFICIENT_ATTENTION, False),
                SdpaCandidate("math", SDPBackend.MATH, True)]
    return [SdpaCandidate("flash", SDPBackend.FLASH_ATTENTION, True),
            SdpaCandidate("math", SDPBackend.MATH, True)]


def mask_kind(q_len: int, ctx: int) -> str:
    """``none`` (one query token sees everything), ``causal`` (square) or ``lower_right``."""
    if q_len == 1:
        return "none"
    return "causal" if ctx == 0 else "lower_right"


def sdpa_attention(cand: SdpaCandidate, q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor,
                   kind: str, scale: float) -> torch.Tensor:
    """SDPA of q4 ``[B, H, Lq, D]`` over k4, v4 ``[B, Hkv, L, D]`` on one backend only."""
    gqa = q4.shape[1] != k4.shape[1]
    with sdpa_kernel(cand.backend):
        if kind == "none":
            return F.scaled_dot_product_attention(q4, k4, v4, scale=scale, enable_gqa=gqa)
        if kind == "causal":
            return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale,
                                                  enable_gqa=gqa)
        if q4.is_cuda and cand.backend == SDPBackend.FLASH_ATTENTION:
            # causal_lower_right runs the flash op (bottom-right causal) exactly when this
            # check passes; otherwise it would silently take another kernel.
            from torch.backends.cuda import SDPAParams, can_use_flash_attention

            try:
                params = SDPAParams(q4, k4, v4, None, 0.0, False, gqa)
            except TypeError:  # torch < 2.5: no enable_gqa
                params = SDPAParams(q4, k4, v4, None, 0.0, False)
            if not can_use_flash_attention(params, False):
                raise RuntimeError("flash refuses this lower-right causal problem")
        bias = causal_lower_right(q4.shape[2], k4.shape[2])
        return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=bias, scale=scale,
                                              enable_gqa=gqa)


def backend_label(cand: SdpaCandidate, kind: str, device_type: str) -> str:
    mask = {"none": "no mask", "causal": "is_causal",
            "lower_right": "causal_lower_right"}[kind]
    if kind == "lower_right" and device_type != "cuda":
        mask += " (materialized bool mask)"
    if kind == "lower_right" and cand.name == "efficient":
        mask += " (custom_mask_type 2)"
    return f"{cand.name}/{mask}" + ("" if cand.native_gqa else "/kv-heads expanded")


def gather_kv(cache: torch.Tensor, gv: GroupView) -> torch.Tensor:
    """The group's KV as ``[B, L, Hkv, D]`` (a view of one index_select copy)."""
    nb, chunk, hkv, d = cache.shape
    b = gv.group.batch
    flat = cache.index_select(0, gv.block_ids)
    return flat.view(b, -1, hkv, d)[:, :gv.kv_len]


def _expand(kv: torch.Tensor, group: int) -> torch.Tensor:
    return kv if group == 1 else kv.repeat_interleave(group, dim=2)


def _q4(p: Problem, gv: GroupView) -> torch.Tensor:
    g = gv.group
    return p.q[gv.tokens].view(g.batch, g.q_len, p.shape.heads, p.shape.head_dim).transpose(1, 2)


def _collect_sdpa(o: torch.Tensor) -> torch.Tensor:
    b, h, lq, d = o.shape
    return o.transpose(1, 2).reshape(b * lq, h, d)


def _pick(run_for: Callable[[SdpaCandidate], Callable[[], torch.Tensor]],
          device_type: str) -> tuple[SdpaCandidate, Callable[[], torch.Tensor]]:
    errors = []
    for cand in sdpa_candidates(device_type):
        try:
            fn = run_for(cand)
            fn()
            return cand, fn
        except Exception as e:  # noqa: BLE001 - try the next backend
            errors.append(f"{cand.name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            if isinstance(e, torch.cuda.OutOfMemoryError):
                break
    raise RuntimeError("no SDPA backend ran: " + " | ".join(errors))


def prepare_ideal(p: Problem) -> Prepared:
    """(a): per homogeneous group, SDPA over KV already contiguous ``[B, L, Hkv, D]``."""
    dev = p.q.device.type
    group_heads = p.shape.heads // p.shape.kv_heads
    parts, labels = [], []
    for gv in p.groups:
        kind = mask_kind(gv.group.q_len, gv.group.ctx)
        q4 = _q4(p, gv)
        k = gather_kv(p.k_cache, gv).contiguous()
        v = gather_kv(p.v_cache, gv).contiguous()

        def run_for(cand: SdpaCandidate, q4=q4, k=k, v=v, kind=kind) -> Callable:
            g = 1 if cand.native_gqa else group_heads
            k4 = _expand(k, g).transpose(1, 2)
            v4 = _expand(v, g).transpose(1, 2)
            return lambda: sdpa_attention(cand, q4, k4, v4, kind, p.scale)

        cand, fn = _pick(run_for, dev)
        parts.append(Part(fn, _collect_sdpa, gv.tokens))
        labels.append(backend_label(cand, kind, dev))
    return Prepared(parts, " + ".join(labels))


def prepare_copy(p: Problem) -> Prepared:
    """(b): per homogeneous group, gather the paged KV (timed), then the same SDPA as (a)."""
    dev = p.q.device.type
    group_heads = p.shape.heads // p.shape.kv_heads
    parts, labels = [], []
    for gv in p.groups:
        kind = mask_kind(gv.group.q_len, gv.group.ctx)
        q4 = _q4(p, gv)

        def run_for(cand: SdpaCandidate, gv=gv, q4=q4, kind=kind) -> Callable:
            g = 1 if cand.native_gqa else group_heads

            def run() -> torch.Tensor:
                k4 = _expand(gather_kv(p.k_cache, gv), g).transpose(1, 2)
                v4 = _expand(gather_kv(p.v_cache, gv), g).transpose(1, 2)
                return sdpa_attention(cand, q4, k4, v4, kind, p.scale)

            return run

        cand, fn = _pick(run_for, dev)
        parts.append(Part(fn, _collect_sdpa, gv.tokens))
        labels.append(backend_label(cand, kind, dev))
    return Prepared(parts, " + ".join(labels))


def prepare_per_token(p: Problem) -> Prepared:
    """(c): one paged_attention_triton launch per query index j, one-token ranges.

    Launch j holds token j of every request with ``q_len > j`` (at position ``ctx + j``); its
    queries are gathered into a contiguous tensor and its outputs scattered back untimed.
    """
    dev = p.q.device
    launches = []
    all_idx = []
    for j in range(p.max_query_len):
        active = [r for r, n in enumerate(p.q_lens) if n > j]
        idx = torch.tensor([p.qsl[r] + j for r in active], dtype=torch.int64, device=dev)
        all_idx.append(idx)
        i32 = dict(dtype=torch.int32, device=dev)
        launches.append((
            p.q.index_select(0, idx).contiguous(),
            torch.arange(len(active) + 1, **i32),
            torch.tensor([p.ctxs[r] + j for r in active], **i32),
            torch.tensor(active, **i32),
            torch.empty(len(active), p.shape.heads, p.shape.head_dim, dtype=p.q.dtype,
                        device=dev),
        ))

    def run() -> torch.Tensor:
        for q_j, qsl_j, pos_j, rows_j, out_j in launches:
            paged_attention_triton(q_j, p.k_cache, p.v_cache, p.block_tables, qsl_j, pos_j,
                                   rows_j, p.scale, 1, out=out_j)
        return p.q  # placeholder: collect reads the launches' outputs

    def collect(_: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(p.q)
        for idx, launch in zip(all_idx, launches):
            out[idx] = launch[4]
        return out

    return Prepared([Part(run, collect, slice(0, p.num_tokens))],
                    f"triton x {p.max_query_len} launches")


def flex_block_mask(p: Problem, q_block: int = 128, kv_block: int = 128):  # noqa: ANN201
    """FlexAttention BlockMask of the batch over the flat paged KV ``[num_blocks * chunk]``.

    mask_mod: query token t (request ``q_req[t]``, position ``q_pos[t]``) sees physical slot s
    iff ``slot_req[s] == q_req[t]`` and ``slot_pos[s] <= q_pos[t]`` (``slot_req`` -1 for slots
    holding no position of any request, ``q_req`` -2 for the padding of the last query block).
    The block sparsity is computed exactly from the block tables (rather than by evaluating
    mask_mod densely, which ``create_block_mask`` would do over T x num_slots): a KV block is
    listed for a query block when a page of one of the block's requests lies in it with its
    first position <= the request's last query position in the block; it is *full* when the
    query block is one request's tokens only and every slot of the KV block holds a position of
    that request <= the query block's first position.
    """
    from torch.nn.attention.flex_attention import BlockMask

    chunk = p.shape.chunk
    if kv_block % chunk:
        raise ValueError(f"kv_block {kv_block} is not a multiple of the chunk size {chunk}")
    t_len = p.num_tokens
    s_len = p.k_cache.shape[0] * chunk
    if s_len % kv_block:
        raise ValueError(f"{s_len} slots are not a multiple of kv_block {kv_block}")
    n_qb = math.ceil(t_len / q_block)
    n_kvb = s_len // kv_block

    q_req = torch.full((n_qb * q_block,), -2, dtype=torch.int32)
    q_pos = torch.zeros(n_qb * q_block, dtype=torch.int32)
    slot_req = torch.full((s_len,), -1, dtype=torch.int32)
    slot_pos = torch.zeros(s_len, dtype=torch.int32)
    dense = torch.zeros(n_qb, n_kvb, dtype=torch.bool)
    for r, (n, ctx) in enumerate(zip(p.q_lens, p.ctxs)):
        t0, t1 = p.qsl[r], p.qsl[r + 1]
        q_req[t0:t1] = r
        q_pos[t0:t1] = torch.arange(ctx, ctx + n, dtype=torch.int32)
        kv_len = ctx + n
        pages = p.tables_cpu[r, :math.ceil(kv_len / chunk)].to(torch.int64)
        pos = torch.arange(kv_len)
        slots = pages[pos // chunk] * chunk + pos % chunk
        slot_req[slots] = r
        slot_pos[slots] = pos.to(torch.int32)
        page_kvb = pages * chunk // kv_block
        for qb in range(t0 // q_block, (t1 - 1) // q_block + 1):
            last_pos = ctx + min(t1, (qb + 1) * q_block) - 1 - t0
            dense[qb, page_kvb[:last_pos // chunk + 1]] = True

    qr = q_req.view(n_qb, q_block)
    sr = slot_req.view(n_kvb, kv_block)
    q_one = (qr.amin(1) == qr.amax(1)) & (qr.amin(1) >= 0)
    kv_one = (sr.amin(1) == sr.amax(1)) & (sr.amin(1) >= 0)
    full = (q_one[:, None] & kv_one[None, :] & (qr[:, 0][:, None] == sr[:, 0][None, :])
            & (slot_pos.view(n_kvb, kv_block).amax(1)[None, :]
               <= q_pos.view(n_qb, q_block).amin(1)[:, None]))
    if not bool((dense | ~full).all()):
        raise AssertionError("a full block outside the listed blocks")
    partial = dense & ~full

    dev = p.q.device

    def ordered(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = m.sum(-1, dtype=torch.int32)
        idx = torch.argsort(m.to(torch.int8), dim=-1, descending=True, stable=True)
        return num[None, None].to(dev), idx.to(torch.int32)[None, None].to(dev)

    q_req_d, q_pos_d = q_req.to(dev), q_pos.to(dev)
    slot_req_d, slot_pos_d = slot_req.to(dev), slot_pos.to(dev)

    def mask_mod(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return (q_req_d[q_idx] == slot_req_d[kv_idx]) & (slot_pos_d[kv_idx] <= q_pos_d[q_idx])

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx,
                                    BLOCK_SIZE=(q_block, kv_block), mask_mod=mask_mod,
                                    seq_lengths=(t_len, s_len))


_COMPILED_FLEX = None


def _flex_fn(compiled: bool) -> Callable:
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    if _COMPILED_FLEX is None:
        import torch._dynamo

        # one compile per configuration's shapes: keep them all
        for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, max(256, getattr(torch._dynamo.config,
                                                                     knob)))
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


def prepare_flex(p: Problem, kv_block: int = 128) -> Prepared:
    """(d): FlexAttention of q ``[1, H, T, D]`` over the cache as ``[1, Hkv, slots, D]``.

    Query blocks of 128 tokens, KV blocks of ``kv_block`` slots (a multiple of the chunk; with
    the chunk itself, 32, every KV block is one page and the sparsity is exact, at the price of
    the kernel's BLOCK_N forced to 32).
    """
    compiled = p.q.is_cuda
    if not compiled:
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    fn = _flex_fn(compiled)
    nb, chunk, hkv, d = p.k_cache.shape
    q4 = p.q.unsqueeze(0).transpose(1, 2)
    k4 = p.k_cache.view(1, nb * chunk, hkv, d).transpose(1, 2)
    v4 = p.v_cache.view(1, nb * chunk, hkv, d).transpose(1, 2)
    bm = flex_block_mask(p, kv_block=kv_block)
    gqa = p.shape.heads != p.shape.kv_heads
    opts = {"BLOCK_N": kv_block} if kv_block < 128 and compiled else None

    def run() -> torch.Tensor:
        return fn(q4, k4, v4, block_mask=bm, scale=p.scale, enable_gqa=gqa, kernel_options=opts)

    return Prepared([Part(run, lambda o: o[0].transpose(0, 1), slice(0, p.num_tokens))],
                    "flex_attention" + (" (torch.compile)" if compiled else " (eager)")
                    + f", blocks 128x{kv_block}")


PREPARE = {"ours": prepare_ours, "a": prepare_ideal, "b": prepare_copy,
           "c": prepare_per_token, "d": prepare_flex}


