"""``benchmarks/swap_bandwidth.py --steps K``: the in + out steps back to back. Their plans
(no block both swapped in and out, so no step waits for an earlier one's swap-outs) and the
step loop, run on the staged method's stream logic over the CPU stream simulator and checked
against the block-by-block reference."""

from __future__ import annotations

import importlib
import random

import pytest
import torch
from swap_util import apply_reference, assert_tiers, make_caches, make_swapper, snapshot
from test_swap_streams import SimStreams


@pytest.mark.parametrize("n,steps,gpu,cpu", [(4, 6, 40, 40), (4, 6, 16, 24), (8, 3, 16, 16)])
def test_step_plans_never_swap_a_block_both_ways(n: int, steps: int, gpu: int, cpu: int
                                                 ) -> None:
    bw = importlib.import_module("swap_bandwidth")
    plans = bw.step_plans(n, steps, gpu, cpu, random.Random(n * steps))
    assert len(plans) == steps
    g_in = {g for p in plans for _, g in p.swap_in}
    c_in = {c for p in plans for c, _ in p.swap_in}
    g_out = {g for p in plans for g, _ in p.swap_out}
    c_out = {c for p in plans for _, c in p.swap_out}
    assert not g_in & g_out and not c_in & c_out
    sets = max(1, min(steps, gpu // (2 * n), cpu // (2 * n)))
    for k, p in enumerate(plans):
        assert len(p.swap_in) == len(p.swap_out) == n
        assert p is plans[k % sets]  # they cycle through the disjoint plans
        p.check(gpu, cpu)
    assert len({id(p) for p in plans}) == sets


@pytest.mark.parametrize("seed", range(4))
def test_steps_back_to_back_move_the_reference_bytes(seed: int) -> None:
    bw = importlib.import_module("swap_bandwidth")
    rng = random.Random(seed)
    caches = list(torch.stack(make_caches(4, 24, 2, 1, 4, torch.float32)).unbind(0))
    sw = make_swapper(caches, 20, "staged", streams=SimStreams(rng), staging_chunks=2,
                      in_groups=2, out_groups=2)
    sw.kernels.triton = False  # the torch reference of the gather / scatter
    gpu, cpu = snapshot(sw)
    plans = bw.step_plans(3, 5, 24, 20, rng)
    for p in plans:
        apply_reference(gpu, cpu, p)
    report = bw.swapper_steps(sw, plans)()
    assert set(report) == {"step_s", "enqueue_s"} and report["step_s"] >= report["enqueue_s"]
    assert sw.swap_outs_in_flight == 0  # finish_step waited for every copy
    sw._streams.drain()
    assert_tiers(sw, gpu, cpu)
    assert sw.bytes_in == sw.bytes_out == 5 * 3 * sw.chunk_bytes
