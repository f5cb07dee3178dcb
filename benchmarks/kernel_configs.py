"""The configurations of ``benchmarks/kernel_compare.py`` (which explains the
benchmark): the shapes, the batches of (q_len, ctx) requests it times or checks, and one
problem built from a configuration (a paged KV cache with random block ids and the queries
over it)."""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field

import torch

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


