"""``benchmarks/swap_out_pieces.py``: its cut of copies into pieces, and the staged swap-outs
with its patch still moving the right bytes (on the CPU, where the copy engine is memmove)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from bench_scripts import load
from swap_util import apply_reference, assert_tiers, make_caches, make_swapper, run_step, snapshot

from pensieve.core.outputs import SwapPlan
from pensieve.runner.swap_staged import StagedPaths


def test_split_pieces_covers_every_byte_in_order() -> None:
    mod = load("swap_out_pieces")
    dsts = np.array([1000, 50_000], dtype=np.uint64)
    srcs = np.array([7, 90_000], dtype=np.uint64)
    sizes = np.array([25, 8], dtype=np.uint64)
    d, s, k = mod.split_pieces(dsts, srcs, sizes, 10)
    assert d.tolist() == [1000, 1010, 1020, 50_000]
    assert s.tolist() == [7, 17, 27, 90_000]
    assert k.tolist() == [10, 10, 5, 8]


def test_patched_staged_swap_outs_match_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = load("swap_out_pieces")
    monkeypatch.setattr(StagedPaths, "_dma_rows", StagedPaths._dma_rows)  # restored after
    caches = make_caches(3, 16, 4, 2, 8, torch.float32)
    sw = make_swapper(caches, 12, "staged")
    sw.out_groups = 1  # the patched host copies: swap-outs of all layers at once
    piece = sw.block_bytes  # one layer of a chunk a piece: 3 pieces a chunk
    mod.patch(piece)
    gpu, cpu = snapshot(sw)
    rng = random.Random(0)
    before = sw.num_copies
    g, c = rng.sample(range(16), 5), rng.sample(range(12), 5)
    plan = SwapPlan(swap_out=list(zip(g, c, strict=True)))
    run_step(sw, plan)
    sw.finish_step()
    apply_reference(gpu, cpu, plan)
    assert_tiers(sw, gpu, cpu)
    assert sw.num_copies - before >= 3 * 5  # every chunk cut into one piece a layer
