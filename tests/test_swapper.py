"""KVSwapper: the CPU tier and the step's swap copies, against a block-by-block reference.

The reference applies a SwapPlan one pair at a time, in the documented order
(swap_out_first, swap_in, swap_out). Every test runs on the CPU (the engine's CPU path: no
streams, swap-ins at ``layer_ready``), with every copy method (the staged one's swap kernel through
Triton's interpreter); the ``cuda`` cases run the same plans on the GPU and add races that only the
copy streams' events prevent (the compute stream is stalled with ``torch.cuda._sleep`` so that
a missing wait reads or writes too early). The stream ordering itself: ``test_swap_streams.py``.
"""

from __future__ import annotations

import random
from collections import deque

import pytest
import torch
from swap_util import (  # noqa: F401  (_seed: the autouse fixture)
    DEVICES,
    HAS_CUDA,
    METHODS,
    PATTERNS,
    SLEEP_CYCLES,
    STAGING,
    STREAM_METHODS,
    _seed,
    apply_reference,
    assert_tiers,
    block_ids,
    cuda,
    make_caches,
    make_swapper,
    new_swapper,
    run_step,
    snapshot,
)

from pensieve.core.outputs import SwapPlan
from pensieve.engine.kv_layout import KVLayout
from pensieve.runner import swap_copies, swap_streams
from pensieve.runner.swapper import (
    InFlight,
    KVSwapper,
    StepWaits,
    pop_completed,
    step_waits,
)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("cpu_pattern", PATTERNS)
@pytest.mark.parametrize("gpu_pattern", PATTERNS)
@pytest.mark.parametrize("chunk,layers,dtype", [(4, 2, torch.bfloat16), (8, 3, torch.float32)])
def test_round_trip_restores_bytes_in_other_blocks(
    device: str, method: str, cpu_pattern: str, gpu_pattern: str, chunk: int, layers: int,
    dtype: torch.dtype,
) -> None:
    rng = random.Random(f"{cpu_pattern}{gpu_pattern}{chunk}")
    sw = make_swapper(make_caches(layers, 40, chunk, dtype=dtype, device=device), 32, method)
    n = 9
    src = block_ids(rng, n, 20, gpu_pattern)
    dst = [20 + i for i in block_ids(rng, n, 20, gpu_pattern)]  # disjoint from src
    cpu = block_ids(rng, n, 32, cpu_pattern)
    original = [g[:, src].cpu().clone() for g in sw.gpu_caches]
    cpu_before = [c.clone() for c in sw.cpu_caches]

    run_step(sw, SwapPlan(swap_out=list(zip(src, cpu, strict=True))))
    for g in sw.gpu_caches:
        g[:, src] = 0  # the GPU copy is gone
    run_step(sw, SwapPlan(swap_in=list(zip(cpu, dst, strict=True))))

    others = sorted(set(range(32)) - set(cpu))
    for layer, g in enumerate(sw.gpu_caches):
        assert torch.equal(g[:, dst].cpu(), original[layer])
        assert torch.equal(sw.cpu_caches[layer][:, cpu], original[layer])
        assert torch.equal(sw.cpu_caches[layer][:, others], cpu_before[layer][:, others])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("seed", [0, 1] + [pytest.param(s, marks=pytest.mark.slow)
                                           for s in range(2, 6)])
def test_random_plans_match_reference(device: str, method: str, stacked: bool,
                                      seed: int) -> None:
    """Several steps of random plans; the lists may share blocks (order decides the result).
    ``stacked``: the caches are views of one allocation (one launch covers every layer)."""
    _random_plans(device, method, stacked, seed)


def _random_plans(device: str, method: str, stacked: bool, seed: int) -> None:
    rng = random.Random(seed)
    gpu_blocks, cpu_blocks = 48, 40
    caches = make_caches(3, gpu_blocks, 4, device=device)
    if stacked:
        caches = list(torch.stack(caches).unbind(0))
    sw = make_swapper(caches, cpu_blocks, method)
    assert (sw.kernels.gpu_stack is not None) == stacked
    gpu, cpu = snapshot(sw)
    for _ in range(5):
        lists = []
        for _ in range(3):
            n = rng.choice([0, 1, 2, 5, 11])
            pattern = rng.choice(PATTERNS)
            g = block_ids(rng, n, gpu_blocks, pattern) if n else []
            c = block_ids(rng, n, cpu_blocks, rng.choice(PATTERNS)) if n else []
            lists.append(list(zip(g, c, strict=True)))
        plan = SwapPlan(swap_out_first=lists[0], swap_in=[(c, g) for g, c in lists[1]],
                        swap_out=lists[2])
        run_step(sw, plan)
        apply_reference(gpu, cpu, plan)
        assert_tiers(sw, gpu, cpu)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
def test_swap_out_first_then_swap_in_into_the_same_gpu_block(device: str, method: str) -> None:
    """An urgent eviction frees GPU block 5 for a swap-in in the same step."""
    sw = make_swapper(make_caches(device=device), 8, method)
    old = [g[:, 5].cpu().clone() for g in sw.gpu_caches]
    new = [c[:, 6].clone() for c in sw.cpu_caches]
    run_step(sw, SwapPlan(swap_out_first=[(5, 2)], swap_in=[(6, 5)]))
    for layer in range(sw.num_layers):
        assert torch.equal(sw.cpu_caches[layer][:, 2], old[layer])
        assert torch.equal(sw.gpu_caches[layer][:, 5].cpu(), new[layer])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
def test_swap_in_reads_a_cpu_block_before_swap_out_overwrites_it(device: str,
                                                                  method: str) -> None:
    sw = make_swapper(make_caches(device=device), 8, method)
    in_data = [c[:, 3].clone() for c in sw.cpu_caches]
    out_data = [g[:, 7].cpu().clone() for g in sw.gpu_caches]
    run_step(sw, SwapPlan(swap_in=[(3, 1)], swap_out=[(7, 3)]))
    for layer in range(sw.num_layers):
        assert torch.equal(sw.gpu_caches[layer][:, 1].cpu(), in_data[layer])
        assert torch.equal(sw.cpu_caches[layer][:, 3], out_data[layer])


def test_cpu_swap_in_is_done_layer_by_layer_at_layer_ready() -> None:
    sw = make_swapper(make_caches(layers=3), 8)
    plan = SwapPlan(swap_in=[(0, 4), (1, 9), (2, 5)])
    ready = sw.start_step(plan)
    assert ready is not None
    for layer in range(3):
        ready(layer)
        for done in range(layer + 1):
            assert torch.equal(sw.gpu_caches[done][:, [4, 9, 5]], sw.cpu_caches[done][:, :3])
    ready(1)  # calling again (or out of order) is harmless
    with pytest.raises(IndexError):
        ready(3)
    with pytest.raises(IndexError):
        ready(-1)  # an unnumbered attention layer
    sw.finish_step()


def test_finish_step_completes_layers_never_announced() -> None:
    sw = make_swapper(make_caches(layers=3), 8)
    gpu, cpu = snapshot(sw)
    plan = SwapPlan(swap_in=[(0, 4)], swap_out=[(10, 1)])
    ready = sw.start_step(plan)
    assert ready is not None
    ready(0)
    sw.finish_step()
    apply_reference(gpu, cpu, plan)
    assert_tiers(sw, gpu, cpu)
    ready(2)  # after the step: no copies are repeated
    assert_tiers(sw, gpu, cpu)


def test_start_step_finishes_a_step_left_in_flight() -> None:
    sw = make_swapper(make_caches(), 8)
    gpu, cpu = snapshot(sw)
    first = SwapPlan(swap_in=[(0, 3)], swap_out=[(5, 6)])
    second = SwapPlan(swap_out_first=[(3, 7)])
    sw.start_step(first)
    run_step(sw, second)
    apply_reference(gpu, cpu, first)
    apply_reference(gpu, cpu, second)
    assert_tiers(sw, gpu, cpu)


def test_callback_only_when_there_is_something_to_wait_for() -> None:
    sw = make_swapper(make_caches(), 8)
    assert sw.start_step(SwapPlan()) is None
    sw.finish_step()
    assert sw.start_step(SwapPlan(swap_out=[(1, 1)])) is None  # background only
    sw.finish_step()
    # On the CPU the urgent evictions are done when start_step returns.
    assert sw.start_step(SwapPlan(swap_out_first=[(1, 2)])) is None
    sw.finish_step()
    assert callable(sw.start_step(SwapPlan(swap_in=[(1, 1)])))
    sw.finish_step()


def test_counters_and_staging_growth() -> None:
    layers, chunk, heads, dim = 3, 4, 2, 8
    sw = make_swapper(make_caches(layers, 64, chunk, heads, dim), 48)
    per_block = layers * 2 * chunk * heads * dim * 2  # bf16
    assert sw.chunk_bytes == sw.layer_bytes * layers == per_block
    gpu, cpu = snapshot(sw)
    rng = random.Random(0)
    total_in = total_out = 0
    for n in (1, 4, 16, 3, 32):
        swap_in = zip(block_ids(rng, n, 48, "mixed"), block_ids(rng, n, 32, "mixed"), strict=True)
        swap_out = zip([32 + g for g in block_ids(rng, n, 32, "mixed")],
                       block_ids(rng, n, 48, "mixed"), strict=True)
        plan = SwapPlan(swap_in=list(swap_in), swap_out=list(swap_out))
        run_step(sw, plan)
        apply_reference(gpu, cpu, plan)
        assert_tiers(sw, gpu, cpu)
        total_in += n * per_block
        total_out += n * per_block
        assert (sw.bytes_in, sw.bytes_out) == (total_in, total_out)
    staging = sw.dma.staging.numel()
    run_step(sw, SwapPlan(swap_in=[(0, 7), (5, 3)]))
    assert sw.dma.staging.numel() == staging  # kept, not reallocated smaller


def test_copies_per_run_not_per_chunk() -> None:
    sw = make_swapper(make_caches(layers=2, blocks=64), 64)
    gpu, cpu = snapshot(sw)
    # Direct: one run, consecutive on both sides -> one copy for K and one for V, no staging.
    plan = SwapPlan(swap_in=list(zip(range(40, 48), range(3, 11), strict=True)),
                    swap_out=[(30, 20), (31, 21), (20, 50), (21, 51)])
    run_step(sw, plan)
    assert sw.num_copies == 2 * 2 * 3  # layers x runs x (K, V)
    assert sw.dma.staging.numel() == 0
    # CPU ids 10..19 and 30..39 (two runs), GPU ids scattered: still two copies per run.
    gpu_ids = random.Random(0).sample(range(64), 20)
    plan2 = SwapPlan(swap_out=list(zip(gpu_ids, [*range(10, 20), *range(30, 40)], strict=True)))
    run_step(sw, plan2)
    assert sw.num_copies == 12 + 2 * 2 * 2
    assert sw.dma.staging.numel() > 0
    apply_reference(gpu, cpu, plan)
    apply_reference(gpu, cpu, plan2)
    assert_tiers(sw, gpu, cpu)


def test_no_cpu_tier() -> None:
    caches = make_caches()
    sw = new_swapper(caches, 0)
    assert [tuple(c.shape) for c in sw.cpu_caches] == [(2, 0, 4, 2, 8)] * 3
    assert sw.start_step(SwapPlan()) is None
    sw.finish_step()
    assert (sw.bytes_in, sw.bytes_out) == (0, 0)
    with pytest.raises(ValueError):
        sw.start_step(SwapPlan(swap_out=[(0, 0)]))


@pytest.mark.parametrize("plan", [
    SwapPlan(swap_in=[(8, 0)]),                      # cpu block out of range
    SwapPlan(swap_out=[(24, 0)]),                    # gpu block out of range
    SwapPlan(swap_out_first=[(-1, 0)]),
    SwapPlan(swap_in=[(1, 3), (2, 3)]),              # two chunks into one gpu block
    SwapPlan(swap_out=[(1, 3), (2, 3)]),             # two chunks into one cpu block
    SwapPlan(swap_out=[(1, 3), (1, 4)]),
])
@pytest.mark.parametrize("method", METHODS)
def test_invalid_plans_are_rejected(plan: SwapPlan, method: str) -> None:
    sw = make_swapper(make_caches(), 8, method)
    gpu, cpu = snapshot(sw)
    with pytest.raises(ValueError):
        sw.start_step(plan)
    sw.finish_step()
    assert_tiers(sw, gpu, cpu)
    assert (sw.bytes_in, sw.bytes_out) == (0, 0)


def test_cache_validation() -> None:
    one = KVLayout(1, 2, 8, 4, torch.float32)
    two = KVLayout(2, 2, 8, 4, torch.float32)
    with pytest.raises(ValueError):
        KVSwapper(one, [], 4)
    with pytest.raises(ValueError):
        KVSwapper(one, [torch.zeros(2, 4, 4, 2)], 4)
    with pytest.raises(ValueError):
        KVSwapper(two, [torch.zeros(2, 4, 4, 2, 8), torch.zeros(2, 5, 4, 2, 8)], 4)
    # caches that are not the layout's: layers, chunk shape, dtype
    caches = [torch.zeros(2, 4, 4, 2, 8), torch.zeros(2, 4, 4, 2, 8)]
    KVSwapper(two, caches, 4)
    for wrong in (one, KVLayout(2, 2, 8, 8, torch.float32), KVLayout(2, 1, 8, 4, torch.float32),
                  KVLayout(2, 2, 8, 4, torch.bfloat16)):
        with pytest.raises(ValueError, match="KV layout"):
            KVSwapper(wrong, caches, 4)


# ---------------------------------------------------------------- CUDA: stream ordering


def big_swapper(layers: int = 4, blocks: int = 256) -> KVSwapper:
    caches = make_caches(layers, blocks, 32, 8, 128, torch.float16, "cuda")
    sw = make_swapper(caches, blocks)
    torch.cuda.synchronize()
    return sw


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_cpu_tier_is_pinned() -> None:
    sw = big_swapper(layers=2, blocks=8)
    assert sw.pinned and all(c.is_pinned() for c in sw.cpu_caches)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.gpu
@pytest.mark.parametrize("pattern", ["contiguous", "scattered"])
def test_cuda_layer_ready_orders_compute_after_swap_in(pattern: str) -> None:
    sw = big_swapper()
    rng = random.Random(0)
    cpu = block_ids(rng, 100, 256, pattern)
    gpu = block_ids(rng, 100, 256, pattern)
    for g in sw.gpu_caches:
        g.zero_()
    gidx = torch.tensor(gpu, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    ready = sw.start_step(SwapPlan(swap_in=list(zip(cpu, gpu, strict=True))))
    assert ready is not None
    reads = []
    for layer, g in enumerate(sw.gpu_caches):
        ready(layer)
        reads.append(g.index_select(1, gidx))  # a kernel on the compute stream
    sw.finish_step()
    torch.cuda.synchronize()
    for layer, r in enumerate(reads):
        assert torch.equal(r.cpu(), sw.cpu_caches[layer][:, cpu]), f"layer {layer}"


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_compute_writes_wait_for_swap_out_first() -> None:
    sw = big_swapper()
    gpu = list(range(0, 200, 2))
    cpu = list(range(100))
    old = [g[:, gpu].cpu() for g in sw.gpu_caches]
    gidx = torch.tensor(gpu, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    ready = sw.start_step(SwapPlan(swap_out_first=list(zip(gpu, cpu, strict=True))))
    assert ready is not None
    for layer, g in enumerate(sw.gpu_caches):
        ready(layer)
        g.index_fill_(1, gidx, 7.0)  # store_kv into the reused blocks
    sw.finish_step()
    torch.cuda.synchronize()
    for layer, g in enumerate(sw.gpu_caches):
        assert torch.equal(sw.cpu_caches[layer][:, cpu], old[layer]), f"layer {layer}"
        assert bool((g[:, gpu] == 7).all())


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_swap_out_waits_for_earlier_compute_writes() -> None:
    sw = big_swapper()
    gpu = list(range(50, 150))
    cpu = list(range(0, 200, 2))
    gidx = torch.tensor(gpu, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    for g in sw.gpu_caches:
        g.index_fill_(1, gidx, 3.0)  # the previous step's writes, still queued
    assert sw.start_step(SwapPlan(swap_out=list(zip(gpu, cpu, strict=True)))) is None
    sw.finish_step()
    for c in sw.cpu_caches:
        assert bool((c[:, cpu] == 3).all())


# ---------------------------------------------------------------- ordering logic (pure)


def test_step_waits_without_conflicts() -> None:
    plan = SwapPlan(swap_out_first=[(1, 1)], swap_in=[(2, 3)], swap_out=[(4, 5)])
    assert step_waits(plan, []) == StepWaits(-1, False)
    busy = [InFlight(frozenset({6, 7}), frozenset({8})), InFlight(frozenset({9}), frozenset())]
    assert step_waits(plan, busy) == StepWaits(-1, False)


def test_step_waits_in_stream_waits_for_the_newest_conflicting_batch() -> None:
    busy = [InFlight(frozenset({1}), frozenset({10})), InFlight(frozenset({2}), frozenset({11})),
            InFlight(frozenset({3}), frozenset({12}))]
    # a swap-in reads CPU block 2 while batch 1 still writes it
    assert step_waits(SwapPlan(swap_in=[(2, 0)]), busy).in_after == 1
    # an urgent swap-out writes CPU block 3 (freed, reused) that batch 2 still writes
    assert step_waits(SwapPlan(swap_out_first=[(0, 3)]), busy).in_after == 2
    # a swap-in overwrites GPU block 10 that batch 0 still reads
    assert step_waits(SwapPlan(swap_in=[(5, 10)]), busy).in_after == 0
    # several: the newest one (its event covers the older: one stream)
    assert step_waits(SwapPlan(swap_in=[(1, 0), (3, 4)]), busy).in_after == 2
    # reading a GPU block an in-flight batch reads, or writing a CPU block a background batch
    # writes later on the same stream: no wait
    assert step_waits(SwapPlan(swap_out_first=[(10, 7)]), busy).in_after == -1
    assert step_waits(SwapPlan(swap_out=[(20, 1)]), busy) == StepWaits(-1, False)


@pytest.mark.parametrize("plan,wait", [
    (SwapPlan(swap_in=[(3, 1)], swap_out=[(7, 3)]), True),        # CPU block read, then written
    (SwapPlan(swap_out_first=[(2, 3)], swap_out=[(7, 3)]), True),  # CPU block written twice
    (SwapPlan(swap_in=[(4, 7)], swap_out=[(7, 3)]), True),         # GPU block written, then read
    (SwapPlan(swap_out_first=[(7, 1)], swap_out=[(7, 3)]), False),  # GPU block read twice
    (SwapPlan(swap_in=[(4, 1)], swap_out=[(7, 3)]), False),
    (SwapPlan(swap_in=[(3, 1)]), False),
])
def test_step_waits_out_stream_after_in_stream(plan: SwapPlan, wait: bool) -> None:
    assert step_waits(plan, []).out_after_in is wait


def test_pop_completed_stops_at_the_first_running_batch() -> None:
    fifo = deque([1, 2, 3, 4])
    assert pop_completed(fifo, lambda b: b in (1, 3)) == 3
    assert list(fifo) == [2, 3, 4]
    assert pop_completed(fifo, lambda b: True) == 0
    assert pop_completed(deque(), lambda b: False) == 0


def test_stacked_layer_views() -> None:
    caches = KVLayout(3, 2, 8, 4, torch.bfloat16).allocate(5, torch.device("cpu"))
    stack = swap_copies.stacked_layers(caches)
    assert stack is not None and stack.shape == (3, 2, 5, 4, 2, 8)
    assert all(stack[i].data_ptr() == c.data_ptr() for i, c in enumerate(caches))
    assert swap_copies.stacked_layers(make_caches()) is None
    base = torch.zeros(4, 2, 5, 4, 2, 8)
    assert swap_copies.stacked_layers([base[0], base[1], base[3]]) is None  # uneven spacing
    assert swap_copies.stacked_layers([base[2], base[1]]) is None  # descending


def test_method_choice() -> None:
    assert make_swapper(make_caches(), 4).method == "dma"  # CPU default
    assert new_swapper(make_caches(), 4, "staged").method == "staged"
    for removed in ("memcpy", "kernel", "hybrid"):
        with pytest.raises(ValueError):
            new_swapper(make_caches(), 4, removed)
    with pytest.raises(ValueError):
        new_swapper(make_caches(), 4, "staged", staging_chunks=0)


@pytest.mark.parametrize("method", METHODS)
def test_host_layout_and_cpu_cache_views(method: str) -> None:
    """cpu_caches are per-layer [2, N, C, Hkv, D] views of host_tier in either layout;
    chunk-major: one chunk of every layer is one contiguous piece."""
    layers, n = 3, 6
    sw = new_swapper(make_caches(layers), n, method)
    host = sw.host_tier
    assert host.is_contiguous()
    for c in sw.cpu_caches:
        assert c.shape == (2, n, 4, 2, 8)
        c.copy_(torch.randn(c.shape).to(c.dtype))
        assert c.untyped_storage().data_ptr() == host.untyped_storage().data_ptr()
    if method == "staged":
        assert sw.host_layout == "chunk-major" and host.shape == (n, layers, 2, 4, 2, 8)
        assert not sw.cpu_caches[0].is_contiguous()
        for layer, c in enumerate(sw.cpu_caches):
            assert torch.equal(host[:, layer].transpose(0, 1), c)
    else:
        assert sw.host_layout == "layer-major" and host.shape == (layers, 2, n, 4, 2, 8)
        assert all(c.is_contiguous() for c in sw.cpu_caches)
        assert torch.equal(torch.stack(sw.cpu_caches), host)


def test_runs_of() -> None:
    assert swap_streams.runs_of([]) == []
    assert swap_streams.runs_of([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert swap_streams.runs_of([1, 3, 5]) == [(0, 1, 1), (1, 3, 1), (2, 5, 1)]


def test_staged_copies_per_run_and_bounded_staging() -> None:
    """Swap-outs (and staged swap-ins) go through at most staging_chunks rows per half, one
    gather per piece and one host copy per run of consecutive CPU ids within a piece."""
    caches = list(torch.stack(make_caches(2, 40, 4, 2, 8)).unbind(0))
    # out_groups=1: swap-outs of all layers at once (by groups: the test below)
    sw = make_swapper(caches, 32, "staged", staging_chunks=5, out_groups=1)
    gpu, cpu = snapshot(sw)
    gpu_ids = random.Random(0).sample(range(40), 12)
    cpu_ids = [*range(10, 17), 20, 22, *range(25, 28)]  # runs 10..16 | 20 | 22 | 25..27
    plan = SwapPlan(swap_out=list(zip(gpu_ids, cpu_ids[::-1], strict=True)))
    run_step(sw, plan)
    apply_reference(gpu, cpu, plan)
    assert_tiers(sw, gpu, cpu)
    # pieces by CPU id: 10..14 | 15 16 20 22 25 | 26 27 -> runs 1 + 4 + 1, gathers 3
    assert sw.num_copies == 3 + 6
    assert [t.shape[0] for t in sw.staged.out_stage] == [5, 5]
    plan = SwapPlan(swap_in=list(zip(cpu_ids, random.Random(1).sample(range(40), 12),
                                     strict=True)))
    before = sw.num_copies
    run_step(sw, plan)
    apply_reference(gpu, cpu, plan)
    assert_tiers(sw, gpu, cpu)
    assert sw.num_copies - before == 3 + 6 and sw.staged.in_stage is not None
    assert sw.staged.in_stage.shape[0] == 5


def test_staged_swap_outs_by_groups_of_layers() -> None:
    """By groups of layers: per piece, one gather and one host copy per chunk for each
    group; the staging halves hold the same rows, packed by group."""
    caches = list(torch.stack(make_caches(3, 40, 4, 2, 8)).unbind(0))
    sw = make_swapper(caches, 32, "staged", staging_chunks=5, out_groups=2)  # layers 0 | 1..2
    gpu, cpu = snapshot(sw)
    plan = SwapPlan(swap_out=list(zip(random.Random(0).sample(range(40), 12),
                                      random.Random(1).sample(range(32), 12), strict=True)))
    run_step(sw, plan)
    apply_reference(gpu, cpu, plan)
    assert_tiers(sw, gpu, cpu)
    assert sw.num_copies == 3 * 2 + 12 * 2  # 3 pieces: gathers per group, copies per chunk
    assert [t.shape[0] for t in sw.staged.out_stage] == [5, 5]
