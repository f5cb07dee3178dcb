"""Figure 12: our paged attention kernel against the alternatives, for one attention layer.

Llama 2-13B GQA shape (40 query heads, 10 KV heads, head_dim 128, bf16), KV cache paged in
32-token blocks whose ids are a random permutation (no request's blocks are contiguous). Every
configuration is a batch of requests, request ``r`` with ``q_len`` new tokens after ``ctx``
cached ones: its query tokens sit at positions ``ctx .. ctx + q_len - 1`` and attend causally
to positions ``0 .. p`` (``ctx + q_len`` KV positions in all). The variants, all computing the
same attention:

    ours  paged_attention_triton over the paged cache, one launch for the whole batch
    a     ideal: KV already contiguous per request, torch SDPA (flash backend where it runs)
    b     copy-then-attend: gather the paged KV into contiguous tensors, then (a); the time
          includes the copy
    c     single-token paged attention: paged_attention_triton once per query index j (one
          one-token range per request at position ctx + j), i.e. q_len launches, as a
          decode-only kernel would be used for prefill
    d     FlexAttention over the paged cache viewed as one flat KV sequence, with a block mask
          built from the block tables (torch.compile'd on CUDA)

Causal masks for SDPA: ``q_len == 1`` needs none; ``ctx == 0`` is the square ``is_causal``;
otherwise the query is offset, and the mask is ``causal_lower_right`` (bottom-right aligned).
PyTorch's flash kernel is bottom-right aligned by nature, and ``causal_lower_right`` runs it when
``can_use_flash_attention`` allows; the first backend that runs, of flash (GQA native), then
efficient (KV heads expanded to 40, outside (a)'s time but inside (b)'s) and math, is used and
recorded per configuration (``backend_a``, ``backend_b``). On the CPU, flash (the CPU kernel)
gets the lower-right mask materialized as a boolean mask.

Mixed batches (decodes beside prefills) run as one launch for ours, (c) and (d); (a) and (b)
are the *sums* of their homogeneous sub-batches' times, each measured separately.

Timing: CUDA events around each variant, ``--warmup`` runs then the median of ``--iters``
(fewer, down to 3, where one run is long: see ``--budget``). Before timing, every variant's
output is compared with ours (max abs error; ``agree_*`` is error <= atol: 2e-2 for bf16).

On CUDA the default is the full grid (query lengths {1, 16, 64, 128, 256, 512} x contexts
{0, 1024, 4096, 16384}, batch from :func:`batch_size`, plus two mixed batches)::

    python benchmarks/kernel_compare.py --out kernel_compare.json --plot kernel_compare.png

``--check`` (the default without CUDA, where the Triton kernels run in Triton's interpreter)
runs tiny shapes (4 query heads, 2 KV heads, head_dim 32, float32) without timing and checks
that every variant agrees with ours (and ours with the float32 reference).
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

# The Triton interpreter must be chosen before the kernels are decorated.
if not torch.cuda.is_available():
    _already = "pensieve.kernels.triton_attention" in sys.modules
    os.environ["TRITON_INTERPRET"] = "1"
    if _already:  # imported earlier without the interpreter: decorate the kernels again
        importlib.reload(sys.modules["pensieve.kernels.triton_attention"])

import argparse  # noqa: E402
import fnmatch  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.nn.attention.bias import causal_lower_right  # noqa: E402

from pensieve.kernels.launch import paged_attention_triton  # noqa: E402
from pensieve.kernels.reference import paged_attention_ref  # noqa: E402

VARIANTS = ("ours", "a", "b", "c", "d")
VARIANT_NAMES = {
    "ours": "ours (paged, 1 launch)",
    "a": "(a) SDPA, contiguous KV (ideal)",
    "b": "(b) gather KV + SDPA",
    "c": "(c) 1-token paged x q_len",
    "d": "(d) FlexAttention, paged",
}
ATOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

QUERY_LENS = (1, 16, 64, 128, 256, 512)
CONTEXTS = (0, 1024, 4096, 16384)
MAX_BATCH = 64
TOKENS_PER_BATCH = 8192  # query tokens per prefill batch
MAX_KV_TOKENS = 1 << 21  # KV positions per batch: 2M x 5 KiB (K+V, 10 heads, bf16) = 10 GiB

MIXED_NOTE = ("mixed batch: (a) and (b) are the sums of their homogeneous sub-batches' times, "
              "each measured separately")


# ---------------------------------------------------------------------------------------
# configurations


@dataclass(frozen=True)
class Shape:
    heads: int = 40
    kv_heads: int = 10
    head_dim: int = 128
    chunk: int = 32


FULL_SHAPE = Shape()
CHECK_SHAPE = Shape(heads=4, kv_heads=2, head_dim=32, chunk=32)


@dataclass(frozen=True)
class Group:
    """``batch`` requests, each with ``q_len`` new tokens after ``ctx`` cached ones."""

    batch: int
    q_len: int
    ctx: int


@dataclass(frozen=True)
class Config:
    name: str
    groups: tuple[Group, ...]

    @property
    def mixed(self) -> bool:
        return len(self.groups) > 1

    @property
    def num_requests(self) -> int:
        return sum(g.batch for g in self.groups)

    @property
    def num_tokens(self) -> int:
        return sum(g.batch * g.q_len for g in self.groups)

    @property
    def kv_tokens(self) -> int:
        return sum(g.batch * (g.ctx + g.q_len) for g in self.groups)


def batch_size(q_len: int, ctx: int, max_kv_tokens: int = MAX_KV_TOKENS) -> int:
    """Requests per homogeneous configuration.

    Decode (``q_len == 1``): 64 requests. Prefill: about 8192 query tokens, i.e.
    ``8192 // q_len`` requests, at most 64. Then capped so that the batch holds at most
    ``max_kv_tokens`` KV positions (2M: 10 GiB of K+V at the Llama 2-13B shape in bf16, and
    (a) and (b) hold a contiguous copy each), at least 1.
    """
    b = MAX_BATCH if q_len == 1 else max(1, min(MAX_BATCH, TOKENS_PER_BATCH // q_len))
    return max(1, min(b, max_kv_tokens // (ctx + q_len)))


def homogeneous(q_len: int, ctx: int, batch: int | None = None) -> Config:
    b = batch_size(q_len, ctx) if batch is None else batch
    return Config(f"q{q_len}_ctx{ctx}", (Group(b, q_len, ctx),))


def mixed(*groups: Group) -> Config:
    return Config("mixed_" + "+".join(f"{g.batch}x{g.q_len}@{g.ctx}" for g in groups),
                  tuple(groups))


def grid_configs() -> list[Config]:
    """The full grid, then the mixed batches (name ``mixed_<batch>x<q_len>@<ctx>+...``)."""
    configs = [homogeneous(q, c) for c in CONTEXTS for q in QUERY_LENS]
    configs.append(mixed(Group(1, 512, 0), Group(63, 1, 2048)))
    configs.append(mixed(Group(4, 128, 4096), Group(60, 1, 1024)))
    return configs


def check_configs() -> list[Config]:
    """Tiny configurations for ``--check`` (and the CPU test)."""
    return [
        homogeneous(1, 40, batch=3),
        homogeneous(20, 0, batch=2),
        homogeneous(7, 70, batch=3),
        homogeneous(16, 64, batch=2),
        mixed(Group(1, 20, 0), Group(3, 1, 50), Group(2, 7, 33)),
    ]


def select_configs(configs: list[Config], patterns: str | None) -> list[Config]:
    """Keep configs whose name matches any of the comma-separated fnmatch patterns."""
    if not patterns:
        return configs
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    return [c for c in configs if any(fnmatch.fnmatchcase(c.name, p) for p in pats)]


# ---------------------------------------------------------------------------------------
# the problem: a random paged cache and the batch's ranges


@dataclass
class GroupView:
    group: Group
    rows: list[int]  # request indices (= block-table rows)
    tokens: slice  # its tokens in q
    block_ids: torch.Tensor  # [batch * pages] int64, the rows' block ids, row-major

    @property
    def kv_len(self) -> int:
        return self.group.ctx + self.group.q_len


@dataclass
class Problem:
    config: Config
    shape: Shape
    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [num_blocks, chunk, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [R, max_pages] int32
    query_start_loc: torch.Tensor  # [R + 1] int32
    range_start_pos: torch.Tensor  # [R] int32
    range_table: torch.Tensor  # [R] int32
    max_query_len: int
    scale: float
    q_lens: list[int]
    ctxs: list[int]
    qsl: list[int]
    tables_cpu: torch.Tensor
    groups: list[GroupView] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.q.shape[0]


def make_problem(config: Config, shape: Shape, dtype: torch.dtype, device: str | torch.device,
                 seed: int = 0, kv_block_multiple: int = 4) -> Problem:
    """Random q and a random paged cache holding every request's ``ctx + q_len`` positions.

    Block ids are a random permutation of the cache's blocks; the number of blocks is rounded
    up to a multiple of ``kv_block_multiple`` (FlexAttention's 128-position KV blocks). The
    whole cache is filled (unused slots too) so that nothing reads NaN garbage.
    """
    gen = torch.Generator().manual_seed(seed)
    chunk = shape.chunk
    q_lens, ctxs = [], []
    for g in config.groups:
        q_lens += [g.q_len] * g.batch
        ctxs += [g.ctx] * g.batch
    pages = [math.ceil((c + n) / chunk) for c, n in zip(ctxs, q_lens)]
    num_blocks = sum(pages)
    num_blocks += -num_blocks % kv_block_multiple
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(pages), max(pages), dtype=torch.int32)
    nxt = 0
    for r, n in enumerate(pages):
        tables[r, :n] = perm[nxt:nxt + n].to(torch.int32)
        nxt += n
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)

    torch.manual_seed(seed)
    cache_shape = (num_blocks, chunk, shape.kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    q = torch.randn(qsl[-1], shape.heads, shape.head_dim, dtype=dtype, device=device)

    i32 = dict(dtype=torch.int32, device=device)
    p = Problem(
        config=config, shape=shape, q=q, k_cache=k_cache, v_cache=v_cache,
        block_tables=tables.to(device),
        query_start_loc=torch.tensor(qsl, **i32),
        range_start_pos=torch.tensor(ctxs, **i32),
        range_table=torch.arange(len(q_lens), **i32),
        max_query_len=max(q_lens), scale=shape.head_dim ** -0.5,
        q_lens=q_lens, ctxs=ctxs, qsl=qsl, tables_cpu=tables,
    )
    r0 = 0
    for g in config.groups:
        rows = list(range(r0, r0 + g.batch))
        n_pages = math.ceil((g.ctx + g.q_len) / chunk)
        ids = tables[r0:r0 + g.batch, :n_pages].reshape(-1).to(torch.int64).to(device)
        p.groups.append(GroupView(g, rows, slice(qsl[r0], qsl[r0 + g.batch]), ids))
        r0 += g.batch
    return p


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


# ---------------------------------------------------------------------------------------
# running


def run_once(prep: Prepared, p: Problem) -> torch.Tensor:
    """Every part once; their outputs assembled into ``[T, H, D]``."""
    out = torch.full_like(p.q, float("nan"))
    for part in prep.parts:
        out[part.tokens] = part.collect(part.run())
    return out


def time_part(fn: Callable[[], object], warmup: int, iters: int, budget_s: float) -> float:
    """Median CUDA-event time of ``fn`` in microseconds, after ``warmup`` runs.

    Fewer iterations (at least 3) when ``iters`` runs would take longer than ``budget_s``.
    """
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = time.perf_counter() - t0
    for _ in range(max(0, warmup - 1)):
        fn()
    n = max(3, min(iters, int(budget_s / max(one, 1e-9))))
    times = []
    for _ in range(n):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _short(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def run_config(config: Config, shape: Shape, dtype: torch.dtype, device: str, *, timing: bool,
               warmup: int = 3, iters: int = 10, budget_s: float = 3.0, check_ref: bool = False,
               variants: tuple[str, ...] = VARIANTS, seed: int = 0,
               flex_kv_block: int = 128) -> dict:
    """One configuration: outputs compared with ours, then (``timing``) every part timed."""
    p = make_problem(config, shape, dtype, device, seed=seed)
    atol = ATOL[dtype]
    row: dict = {
        "config": config.name,
        "groups": [{"batch": g.batch, "q_len": g.q_len, "ctx": g.ctx} for g in config.groups],
        "mixed": config.mixed,
        "num_requests": config.num_requests,
        "num_tokens": config.num_tokens,
        "kv_tokens": config.kv_tokens,
        "heads": shape.heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "chunk": shape.chunk, "dtype": str(dtype).removeprefix("torch."), "atol": atol,
    }
    if config.mixed:
        row["note"] = MIXED_NOTE
    ours = None
    for v in variants:
        row[f"{v}_us"] = None
        try:
            prep = prepare_flex(p, flex_kv_block) if v == "d" else PREPARE[v](p)
            out = run_once(prep, p)
            row[f"backend_{v}"] = prep.backend
            if v == "ours":
                ours = out
                if check_ref:
                    ref = paged_attention_ref(
                        p.q, p.k_cache, p.v_cache, p.block_tables, p.query_start_loc,
                        p.range_start_pos, p.range_table, p.scale,
                        out=torch.empty(p.q.shape, device=p.q.device))
                    err = (out.float() - ref).abs().max().item()
                    row["err_ref"] = err
                    row["agree_ref"] = bool(err <= atol)
            elif ours is not None:
                err = (out.float() - ours.float()).abs().max().item()  # NaN if unwritten
                row[f"err_{v}"] = err
                row[f"agree_{v}"] = bool(err <= atol)
            if timing:
                row[f"{v}_us"] = sum(time_part(part.run, warmup, iters, budget_s)
                                     for part in prep.parts)
                if len(prep.parts) > 1:
                    row[f"{v}_parts"] = len(prep.parts)
            del prep, out
        except Exception as e:  # noqa: BLE001 - record why, keep going
            row[f"not_run_{v}"] = "not run: " + _short(e)
            if os.environ.get("KERNEL_COMPARE_TRACEBACK"):
                traceback.print_exc()
            if v == "ours":
                break
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    t = {v: row.get(f"{v}_us") for v in variants}
    if t.get("ours"):
        for v in ("b", "c", "d"):
            if t.get(v):
                row[f"{v}_over_ours"] = t[v] / t["ours"]
        if t.get("a"):
            row["ours_over_a"] = t["ours"] / t["a"]
    del p, ours
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


# ---------------------------------------------------------------------------------------
# output


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _status(row: dict, variants: tuple[str, ...]) -> str:
    bad = [v for v in variants if v != "ours" and row.get(f"agree_{v}") is False]
    if row.get("agree_ref") is False:
        bad.append("ref")
    missing = [v for v in variants if f"not_run_{v}" in row]
    s = "ok" if not bad else "DISAGREE: " + ",".join(bad)
    if missing:
        s += " (not run: " + ",".join(missing) + ")"
    return s


def format_table(rows: list[dict], timing: bool, variants: tuple[str, ...] = VARIANTS) -> str:
    if timing:
        head = ["config", "B", "T", *[f"{v} us" for v in variants],
                "ours/a", "b/ours", "c/ours", "d/ours", "check"]
        body = [[r["config"], str(r["num_requests"]), str(r["num_tokens"]),
                 *[_fmt(r.get(f"{v}_us")) for v in variants],
                 _fmt(r.get("ours_over_a"), ".2f"), _fmt(r.get("b_over_ours"), ".2f"),
                 _fmt(r.get("c_over_ours"), ".2f"), _fmt(r.get("d_over_ours"), ".2f"),
                 _status(r, variants)] for r in rows]
    else:
        errs = [v for v in variants if v != "ours"]
        head = ["config", "B", "T", "err ref", *[f"err {v}" for v in errs], "check"]
        body = [[r["config"], str(r["num_requests"]), str(r["num_tokens"]),
                 _fmt(r.get("err_ref"), ".1e"), *[_fmt(r.get(f"err_{v}"), ".1e") for v in errs],
                 _status(r, variants)] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h)
              for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(
        zip(head, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for b in body:
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w)
                               for i, (c, w) in enumerate(zip(b, widths))))
    notes = []
    for r in rows:
        for v in variants:
            if f"not_run_{v}" in r:
                notes.append(f"{r['config']} {v}: {r[f'not_run_{v}']}")
    backends = sorted({f"{v}: {label}" for r in rows for v in ("a", "b")
                       if f"backend_{v}" in r for label in r[f"backend_{v}"].split(" + ")})
    if backends:
        lines.append("backends (per homogeneous sub-batch):")
        lines += [f"  {b}" for b in backends]
    if any(r.get("mixed") for r in rows) and timing:
        lines.append(MIXED_NOTE)
    lines += notes
    return "\n".join(lines)


def plot(rows: list[dict], path: str, variants: tuple[str, ...] = VARIANTS,
         title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("ours_us")]
    n = len(rows)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.6 * n + 2), 5))
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        xs = [k + (i - (len(variants) - 1) / 2) * width for k in range(n)]
        ys = [r.get(f"{v}_us") or float("nan") for r in rows]
        ax.bar(xs, ys, width, label=VARIANT_NAMES[v])
    ax.set_yscale("log")
    ax.set_ylabel("time per attention layer (us, log)")
    ax.set_xticks(range(n))
    ax.set_xticklabels([f"{r['config']}\nB={r['num_requests']}" for r in rows], rotation=60,
                       ha="right", fontsize=7)
    ax.legend(fontsize=8)
    ax.grid(axis="y", which="both", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def environment(device: str) -> dict:
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (triton interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true",
                    help="tiny shapes, correctness only (the default without CUDA)")
    ap.add_argument("--out", help="write the results as JSON (a list of dicts)")
    ap.add_argument("--plot", help="write a PNG of the times (timing runs only)")
    ap.add_argument("--dtype", choices=sorted(DTYPES),
                    help="default bfloat16, float32 with --check")
    ap.add_argument("--iters", type=int, default=10, help="timed iterations (median)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget", type=float, default=3.0,
                    help="seconds per variant and part: fewer iterations (>= 3) beyond it")
    ap.add_argument("--configs", help="comma-separated fnmatch patterns of config names, e.g. "
                    "'q1_*,mixed*' (names: q<q_len>_ctx<ctx>, mixed_<B>x<q_len>@<ctx>+...)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated subset of " + ",".join(VARIANTS) + " (ours first)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--flex-kv-block", type=int, default=128, choices=(32, 64, 128),
                    help="(d)'s KV block size in slots (32: one page per block, exact sparsity)")
    args = ap.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    check = args.check or device == "cpu"
    dtype = DTYPES[args.dtype or ("float32" if check else "bfloat16")]
    variants = tuple(v for v in VARIANTS if v in args.variants.split(","))
    if "ours" not in variants:
        ap.error("--variants must include ours (everything is compared with it)")
    configs = select_configs(check_configs() if check else grid_configs(), args.configs)
    if not configs:
        ap.error(f"no config matches {args.configs!r}")
    shape = CHECK_SHAPE if check else FULL_SHAPE
    env = environment(device)
    print(f"{env['device']}  torch {env['torch']}  triton {env['triton']}  {dtype}  "
          f"heads {shape.heads}/{shape.kv_heads} x {shape.head_dim}, chunk {shape.chunk}"
          + ("  [check: correctness only]" if check else ""), flush=True)

    try:
        from tqdm import tqdm

        bar = tqdm(configs, desc="configs", file=sys.stderr, dynamic_ncols=True)
    except ImportError:
        bar = configs
    rows = []
    for config in bar:
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(config.name)
        row = run_config(config, shape, dtype, device, timing=not check, warmup=args.warmup,
                         iters=args.iters, budget_s=args.budget, check_ref=check,
                         variants=variants, seed=args.seed, flex_kv_block=args.flex_kv_block)
        row.update(env)
        row["iters"] = args.iters
        row["flex_kv_block"] = args.flex_kv_block
        rows.append(row)
        if args.out:  # after every config, so that a crash keeps what ran
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
    print(format_table(rows, timing=not check, variants=variants))
    if args.plot and not check:
        plot(rows, args.plot, variants, title=f"{env['device']}, {dtype}, "
             f"{shape.heads}/{shape.kv_heads} heads x {shape.head_dim}")
        print(f"plot: {args.plot}")
    if args.out:
        print(f"results: {args.out}")
    failed = [r["config"] for r in rows if _status(r, variants).startswith("DISAGREE")
              or "not_run_ours" in r]
    if failed:
        print("FAILED: " + ", ".join(failed))
    return rows


if __name__ == "__main__":
    rows = main()
    sys.exit(1 if any(_status(r, VARIANTS).startswith("DISAGREE") or "not_run_ours" in r
                      for r in rows) else 0)
