"""Shared set-up and helpers of the swapper tests (``test_swapper.py``,
``test_swap_streams.py``): caches, a swapper with a filled CPU tier, the block-by-block
reference of a SwapPlan and the checks against it. Without CUDA the swap kernel runs through
Triton's interpreter (``conftest.py`` chooses it before any kernel module is imported)."""

from __future__ import annotations

import random
import zlib
from typing import Any

import pytest
import torch

from pensieve.core.outputs import SwapPlan
from pensieve.engine.kv_layout import KVLayout
from pensieve.runner.swapper import (
    KVSwapper,
)

HAS_CUDA = torch.cuda.is_available()
cuda = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]
DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]
METHODS = ["staged", "dma"]
STREAM_METHODS = ["staged"]
STAGING = 4  # chunks per staging piece in these tests (several pieces per batch)


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def make_caches(
    layers: int = 3, blocks: int = 24, chunk: int = 4, heads: int = 2, dim: int = 8,
    dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
) -> list[torch.Tensor]:
    return [torch.randn(2, blocks, chunk, heads, dim, dtype=dtype, device=device)
            for _ in range(layers)]


def layout_of(caches: list[torch.Tensor]) -> KVLayout:
    """The KV layout of per-layer ``[2, N, C, Hkv, D]`` caches (what the engine would have
    resolved and allocated them from)."""
    _, _, chunk, heads, dim = caches[0].shape
    return KVLayout(len(caches), heads, dim, chunk, caches[0].dtype)


def new_swapper(caches: list[torch.Tensor], *args: Any, **kw: Any) -> KVSwapper:
    """``KVSwapper`` over ``caches`` and their layout (:func:`layout_of`)."""
    return KVSwapper(layout_of(caches), caches, *args, **kw)


def make_swapper(caches: list[torch.Tensor], cpu_blocks: int, method: str | None = None,
                 **kw: Any) -> KVSwapper:
    if method == "staged":
        kw.setdefault("staging_chunks", STAGING)
    sw = new_swapper(caches, cpu_blocks, method, **kw)
    for c in sw.cpu_caches:
        c.copy_(torch.randn(c.shape).to(c.dtype))
    return sw


def snapshot(sw: KVSwapper) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [g.cpu().clone() for g in sw.gpu_caches], [c.clone() for c in sw.cpu_caches]


def apply_reference(gpu: list[torch.Tensor], cpu: list[torch.Tensor], plan: SwapPlan) -> None:
    """SwapPlan semantics, one chunk at a time, on host copies of both tiers."""
    for g_l, c_l in zip(gpu, cpu, strict=True):
        for g, c in plan.swap_out_first:
            c_l[:, c] = g_l[:, g]
        for c, g in plan.swap_in + plan.swap_in_ahead:
            g_l[:, g] = c_l[:, c]
        for g, c in plan.swap_out:
            c_l[:, c] = g_l[:, g]


def assert_tiers(sw: KVSwapper, gpu: list[torch.Tensor], cpu: list[torch.Tensor]) -> None:
    for layer in range(sw.num_layers):
        assert torch.equal(sw.gpu_caches[layer].cpu(), gpu[layer]), f"gpu tier, layer {layer}"
        assert torch.equal(sw.cpu_caches[layer], cpu[layer]), f"cpu tier, layer {layer}"


def run_step(sw: KVSwapper, plan: SwapPlan) -> None:
    ready = sw.start_step(plan)
    if ready is not None:
        for layer in range(sw.num_layers):
            ready(layer)
    sw.finish_step()


def block_ids(rng: random.Random, n: int, pool: int, pattern: str) -> list[int]:
    """``n`` distinct ids below ``pool``: one run, isolated ids, or a few shuffled runs."""
    if pattern == "contiguous":
        start = rng.randrange(pool - n + 1)
        return list(range(start, start + n))
    if pattern == "scattered":
        return rng.sample(range(0, pool, 2), n)  # no two adjacent: every run has length 1
    ids = sorted(rng.sample(range(pool), n))
    cut = sorted(rng.sample(range(1, n), min(3, n - 1))) if n > 1 else []
    parts = [ids[a:b] for a, b in zip([0, *cut], [*cut, n], strict=True)]
    rng.shuffle(parts)
    return [i for p in parts for i in p]


PATTERNS = ["contiguous", "scattered", "mixed"]
SLEEP_CYCLES = 50_000_000  # ~25 ms: the compute stream is still busy when copies are issued
