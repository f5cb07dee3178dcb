"""KVSwapper: the CPU tier and the step's swap copies, against a block-by-block reference.

The reference applies a SwapPlan one pair at a time, in the documented order
(swap_out_first, swap_in, swap_out). Every test runs on the CPU (the engine's CPU path: no
streams, swap-ins at ``layer_ready``), with both copy methods (the kernel one through Triton's
interpreter); the ``cuda`` cases run the same plans on the GPU and add races that only the
copy streams' events prevent (the compute stream is stalled with ``torch.cuda._sleep`` so that
a missing wait reads or writes too early).

The stream ordering of the kernel, hybrid and staged methods (copy streams, background
swap-outs outliving their step; hybrid: gathers into two staging halves on the out stream,
device-to-host copies on the dma stream) is checked on the CPU by running the swapper's real
issue logic against a simulator of streams and events (:class:`SimStreams`) that executes the
enqueued work in random orders that respect only the waits the swapper asked for; the
simulator is first shown to catch a missing wait (a hazard wait, a staging half reused too
early). The hybrid and staged methods run with a few chunks per staging piece, so batches are
cut into several pieces and both halves are reused.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402
from collections import deque  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from pensieve.core.outputs import SwapPlan  # noqa: E402
from pensieve.kernels import triton_swap  # noqa: E402
from pensieve.runner import swap_copies, swap_streams  # noqa: E402
from pensieve.runner import swapper as swapper_mod  # noqa: E402
from pensieve.runner.swapper import (  # noqa: E402
    InFlight,
    KVSwapper,
    StepWaits,
    pop_completed,
    step_waits,
)

if not torch.cuda.is_available():
    importlib.reload(triton_swap)  # imported before the interpreter was chosen

HAS_CUDA = torch.cuda.is_available()
cuda = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]
DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]
METHODS = ["kernel", "hybrid", "staged", "dma"]
STREAM_METHODS = ["kernel", "hybrid", "staged"]
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


def make_swapper(caches: list[torch.Tensor], cpu_blocks: int, method: str | None = None,
                 **kw: Any) -> KVSwapper:
    if method in ("hybrid", "staged"):
        kw.setdefault("staging_chunks", STAGING)
    sw = KVSwapper(caches, cpu_blocks, method, **kw)
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
    rng = random.Random(seed)
    gpu_blocks, cpu_blocks = 48, 40
    caches = make_caches(3, gpu_blocks, 4, device=device)
    if stacked:
        caches = list(torch.stack(caches).unbind(0))
    sw = make_swapper(caches, cpu_blocks, method)
    assert (sw._gpu_stack is not None) == stacked
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
    assert sw.block_bytes * layers == per_block
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
    staging = sw._staging.numel()
    run_step(sw, SwapPlan(swap_in=[(0, 7), (5, 3)]))
    assert sw._staging.numel() == staging  # kept, not reallocated smaller


def test_copies_per_run_not_per_chunk() -> None:
    sw = make_swapper(make_caches(layers=2, blocks=64), 64)
    gpu, cpu = snapshot(sw)
    # Direct: one run, consecutive on both sides -> one copy for K and one for V, no staging.
    plan = SwapPlan(swap_in=list(zip(range(40, 48), range(3, 11), strict=True)),
                    swap_out=[(30, 20), (31, 21), (20, 50), (21, 51)])
    run_step(sw, plan)
    assert sw.num_copies == 2 * 2 * 3  # layers x runs x (K, V)
    assert sw._staging.numel() == 0
    # CPU ids 10..19 and 30..39 (two runs), GPU ids scattered: still two copies per run.
    gpu_ids = random.Random(0).sample(range(64), 20)
    plan2 = SwapPlan(swap_out=list(zip(gpu_ids, [*range(10, 20), *range(30, 40)], strict=True)))
    run_step(sw, plan2)
    assert sw.num_copies == 12 + 2 * 2 * 2
    assert sw._staging.numel() > 0
    apply_reference(gpu, cpu, plan)
    apply_reference(gpu, cpu, plan2)
    assert_tiers(sw, gpu, cpu)


def test_no_cpu_tier() -> None:
    caches = make_caches()
    sw = KVSwapper(caches, 0)
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
    with pytest.raises(ValueError):
        KVSwapper([], 4)
    with pytest.raises(ValueError):
        KVSwapper([torch.zeros(2, 4, 4, 2)], 4)
    with pytest.raises(ValueError):
        KVSwapper([torch.zeros(2, 4, 4, 2, 8), torch.zeros(2, 5, 4, 2, 8)], 4)


# ---------------------------------------------------------------- CUDA: stream ordering

SLEEP_CYCLES = 50_000_000  # ~25 ms: the compute stream is still busy when copies are issued


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
    from pensieve.runner.model_runner import allocate_kv_caches

    caches = allocate_kv_caches(3, 5, 4, 2, 8, torch.bfloat16, torch.device("cpu"))
    stack = swap_copies.stacked_layers(caches)
    assert stack is not None and stack.shape == (3, 2, 5, 4, 2, 8)
    assert all(stack[i].data_ptr() == c.data_ptr() for i, c in enumerate(caches))
    assert swap_copies.stacked_layers(make_caches()) is None
    base = torch.zeros(4, 2, 5, 4, 2, 8)
    assert swap_copies.stacked_layers([base[0], base[1], base[3]]) is None  # uneven spacing
    assert swap_copies.stacked_layers([base[2], base[1]]) is None  # descending


def test_method_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    assert make_swapper(make_caches(), 4).method == "dma"  # CPU default
    assert make_swapper(make_caches(), 4, "kernel").method == "kernel"
    monkeypatch.setenv("PENSIEVE_SWAP_METHOD", "hybrid")
    assert KVSwapper(make_caches(), 4).method == "hybrid"
    assert KVSwapper(make_caches(), 4, "staged").method == "staged"
    with pytest.raises(ValueError):
        KVSwapper(make_caches(), 4, "memcpy")
    with pytest.raises(ValueError):
        KVSwapper(make_caches(), 4, "hybrid", staging_chunks=0)


@pytest.mark.parametrize("method", METHODS)
def test_host_layout_and_cpu_cache_views(method: str) -> None:
    """cpu_caches are per-layer [2, N, C, Hkv, D] views of host_tier in either layout;
    chunk-major: one chunk of every layer is one contiguous piece."""
    layers, n = 3, 6
    sw = KVSwapper(make_caches(layers), n, method)
    host = sw.host_tier
    assert host.is_contiguous()
    for c in sw.cpu_caches:
        assert c.shape == (2, n, 4, 2, 8)
        c.copy_(torch.randn(c.shape).to(c.dtype))
        assert c.untyped_storage().data_ptr() == host.untyped_storage().data_ptr()
    if method in ("hybrid", "staged"):
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


@pytest.mark.parametrize("method", ["hybrid", "staged"])
def test_staged_copies_per_run_and_bounded_staging(method: str) -> None:
    """Swap-outs (and staged swap-ins) go through at most staging_chunks rows per half, one
    gather per piece and one host copy per run of consecutive CPU ids within a piece."""
    caches = list(torch.stack(make_caches(2, 40, 4, 2, 8)).unbind(0))
    sw = make_swapper(caches, 32, method, staging_chunks=5)
    gpu, cpu = snapshot(sw)
    gpu_ids = random.Random(0).sample(range(40), 12)
    cpu_ids = [*range(10, 17), 20, 22, *range(25, 28)]  # runs 10..16 | 20 | 22 | 25..27
    plan = SwapPlan(swap_out=list(zip(gpu_ids, cpu_ids[::-1], strict=True)))
    run_step(sw, plan)
    apply_reference(gpu, cpu, plan)
    assert_tiers(sw, gpu, cpu)
    # pieces by CPU id: 10..14 | 15 16 20 22 25 | 26 27 -> runs 1 + 4 + 1, gathers 3
    assert sw.num_copies == 3 + 6
    assert [t.shape[0] for t in sw._out_stage] == [5, 5]
    plan = SwapPlan(swap_in=list(zip(cpu_ids, random.Random(1).sample(range(40), 12),
                                     strict=True)))
    sw.num_copies = 0
    run_step(sw, plan)
    apply_reference(gpu, cpu, plan)
    assert_tiers(sw, gpu, cpu)
    if method == "staged":
        assert sw.num_copies == 3 + 6 and sw._in_stage is not None
        assert sw._in_stage.shape[0] == 5
    else:
        assert sw.num_copies == 2 and sw._in_stage is None  # one launch per layer


# ---------------------------------------------------------------- streams, simulated


class SimEvent:
    def __init__(self) -> None:
        self.done = False


class SimStreams:
    """:class:`~pensieve.runner.swapper.Streams` on the CPU: each stream is a queue of work,
    executed in a random order that respects stream order and the waits only (work may run
    at any time after it is enqueued, or as late as a host wait forces it)."""

    def __init__(self, rng: random.Random, eagerness: float = 0.5) -> None:
        self.in_stream, self.out_stream, self.dma_stream = "in", "out", "dma"
        self.queues: dict[str, deque[tuple[str, Any]]] = {
            "in": deque(), "out": deque(), "dma": deque(), "compute": deque()}
        self.rng = rng
        self.eagerness = eagerness

    def _q(self, stream: str | None) -> deque[tuple[str, Any]]:
        return self.queues["compute" if stream is None else stream]

    def record(self, stream: str | None) -> SimEvent:
        event = SimEvent()
        self._q(stream).append(("record", event))
        self.progress()
        return event

    def wait(self, stream: str | None, event: SimEvent) -> None:
        self._q(stream).append(("wait", event))

    def upload(self, stream: str, pairs: list[tuple[int, int]]) -> torch.Tensor:
        return torch.tensor(pairs, dtype=torch.int64).view(-1, 2)

    def run(self, stream: str | None, fn: Callable[[], None]) -> None:
        self._q(stream).append(("run", fn))
        self.progress()

    def query(self, event: SimEvent) -> bool:
        self.progress()
        return event.done

    def synchronize(self, event: SimEvent) -> None:
        if self.rng.random() < self.eagerness:
            while not event.done:  # everything ready may run meanwhile
                assert self.step(), "deadlock: the event can never complete"
        else:
            self.force(event)

    def force(self, event: SimEvent) -> None:
        """Run only what ``event`` depends on: its stream up to its record, and whatever the
        waits on the way depend on."""
        queue = next((q for q in self.queues.values() if ("record", event) in q), None)
        while not event.done:
            assert queue, "deadlock: the event is never recorded"
            kind, x = queue[0]
            if kind == "wait" and not x.done:
                self.force(x)
                continue
            queue.popleft()
            if kind == "record":
                x.done = True
            elif kind == "run":
                x()

    def step(self) -> bool:
        ready = [q for q in self.queues.values()
                 if q and not (q[0][0] == "wait" and not q[0][1].done)]
        if not ready:
            return False
        kind, x = self.rng.choice(ready).popleft()
        if kind == "record":
            x.done = True
        elif kind == "run":
            x()
        return True

    def progress(self) -> None:
        while self.rng.random() < self.eagerness and self.step():
            pass

    def drain(self) -> None:
        while self.step():
            pass
        assert not any(self.queues.values()), "work left behind a wait that never completes"


def simulate(seed: int, steps: int = 8, method: str = "kernel", ahead: bool = True,
             ahead_path: str = "kernel") -> None:
    """Random plans over small pools (blocks collide often) on the kernel method's stream
    logic, with a compute stream that reads each layer's swapped-in blocks after
    ``layer_ready`` and writes blocks the step owns: the urgent swap-outs' sources (reused),
    the swap-ins' destinations (new tokens) and free ones, never a block a background batch
    reported in flight may still read (the contract of ``end_step``'s count). Checks the
    reads, the counts and both tiers against the sequential reference. With ``ahead``, plans
    also carry ``swap_in_ahead`` copies, read by the next step's compute (their CPU blocks left
    alone for two steps, as the cache does)."""
    rng = random.Random(seed)
    layers, g_blocks, c_blocks = 2, 14, 12
    caches = list(torch.stack(make_caches(layers, g_blocks, 2, 1, 4, torch.float32)).unbind(0))
    sim = SimStreams(rng, eagerness=rng.choice([0.2, 0.5, 0.8]))
    sw = make_swapper(caches, c_blocks, method, streams=sim, staging_chunks=1,
                      ahead=ahead_path if method in ("hybrid", "staged") else None)
    sw._triton = False  # the torch reference of the kernel: the streams are under test here
    gpu, cpu = snapshot(sw)
    busy: list[frozenset[int]] = []  # GPU blocks read by batches possibly in flight, oldest first
    out_events: list[Any] = []
    prev_ahead: list[tuple[int, int]] = []  # the previous step's swap_in_ahead
    ahead_cpu: list[set[int]] = [set(), set()]  # CPU blocks of the last two steps' ahead copies
    for step in range(steps):
        reading = set().union(*busy)
        prev_ahead_g = [g for _, g in prev_ahead]  # read by this step's compute

        def pick(pool: list[int], n: int) -> list[int]:
            return rng.sample(pool, min(n, len(pool)))

        def cpu_pick(n: int, avoid: set[int] = ahead_cpu[0] | ahead_cpu[1]) -> list[int]:
            return pick([c for c in range(c_blocks) if c not in avoid], n)

        free_g = [g for g in range(g_blocks) if g not in prev_ahead_g]
        out_first = pick([g for g in free_g if g not in reading], rng.choice([0, 1, 2]))
        swap_in_g = pick([g for g in free_g if g not in out_first], rng.choice([0, 2, 3]))
        swap_out_g = pick(free_g, rng.choice([0, 0, 2, 3]))
        # this step's ahead copies: into blocks no copy or compute of the step touches
        ahead_g = pick([g for g in free_g if g not in reading and g not in out_first
                        and g not in swap_in_g and g not in swap_out_g],
                       rng.choice([0, 0, 1, 2]) if ahead else 0)
        # compute writes: blocks of the step that no copy still reads
        writable = [g for g in free_g if g not in reading and g not in swap_out_g
                    and g not in ahead_g]
        writes = pick(writable, rng.choice([0, 1, 3]))
        swap_in = list(zip(pick(range(c_blocks), len(swap_in_g)), swap_in_g, strict=True))
        ahead_c = cpu_pick(len(ahead_g), ahead_cpu[0] | ahead_cpu[1] | {c for c, _ in swap_in})
        avoid = ahead_cpu[0] | ahead_cpu[1] | set(ahead_c)
        plan = SwapPlan(
            swap_out_first=list(zip(out_first, cpu_pick(len(out_first), avoid), strict=True)),
            swap_in=swap_in,
            swap_out=list(zip(swap_out_g, cpu_pick(len(swap_out_g), avoid), strict=True)),
            swap_in_ahead=list(zip(ahead_c, ahead_g, strict=True)),
        )
        ready = sw.start_step(plan)
        if plan.swap_out:
            out_events.append(sw._in_flight[-1].event)
        reads: dict[int, torch.Tensor] = {}
        for layer in range(layers):
            if ready is not None:
                ready(layer)

            def compute(layer: int = layer, value: float = step * 10.0 + layer + 1,
                        reads: dict[int, torch.Tensor] = reads,
                        dst: list[int] = swap_in_g + prev_ahead_g,
                        writes: list[int] = writes) -> None:
                reads[layer] = caches[layer][:, dst].clone()
                caches[layer][:, writes] = value

            sim.run(None, compute)
        sim.synchronize(sim.record(None))  # the runner's sync of the compute stream
        n = sw.end_step()
        assert n == sum(not e.done for e in out_events), "end_step miscounts"
        # the sequential reference
        for layer in range(layers):
            g_l, c_l = gpu[layer], cpu[layer]
            for g, c in plan.swap_out_first:
                c_l[:, c] = g_l[:, g]
            for c, g in plan.swap_in:
                g_l[:, g] = c_l[:, c]
            assert torch.equal(reads[layer], g_l[:, swap_in_g + prev_ahead_g]), (
                f"step {step} layer {layer}")
            for c, g in plan.swap_in_ahead:
                g_l[:, g] = c_l[:, c]
            g_l[:, writes] = step * 10.0 + layer + 1
            for g, c in plan.swap_out:
                c_l[:, c] = g_l[:, g]
        if plan.swap_out:
            busy.append(frozenset(swap_out_g))
        busy = busy[len(busy) - n:] if n else []
        prev_ahead = plan.swap_in_ahead
        ahead_cpu = [ahead_cpu[1], set(ahead_c)]
    sw.finish_step()
    sim.drain()
    assert_tiers(sw, gpu, cpu)


@pytest.mark.parametrize("method", STREAM_METHODS)
@pytest.mark.parametrize("seed", range(60))
def test_simulated_streams_match_reference(seed: int, method: str) -> None:
    simulate(seed, method=method)


@pytest.mark.parametrize("seed", range(30))
def test_simulated_swap_ins_ahead_through_the_copy_engines(seed: int) -> None:
    """Hybrid with ``ahead="dma"``: the ahead copies run as staged swap-ins do."""
    simulate(seed, method="hybrid", ahead_path="dma")


@pytest.mark.parametrize("method", STREAM_METHODS)
def test_swap_ins_ahead_counted_and_validated_on_streams(method: str) -> None:
    """Ahead copies count in ``bytes_in`` and bad block ids in them are refused, as for the
    step's own swap-ins."""
    sim = SimStreams(random.Random(0), eagerness=0.0)
    sw = make_swapper(make_caches(2, 8, 2, 1, 4, torch.float32), 8, method, streams=sim)
    sw._triton = False
    sw.start_step(SwapPlan(swap_in=[(0, 1)], swap_in_ahead=[(2, 3), (4, 5)]))
    assert sw.bytes_in == 3 * sw.num_layers * sw.block_bytes
    sw.finish_step()
    with pytest.raises(ValueError):
        sw.start_step(SwapPlan(swap_in_ahead=[(0, 99)]))


def test_ahead_path_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    caches = make_caches(2, 4, 2, 1, 4, torch.float32)
    assert make_swapper(caches, 4, "hybrid").ahead == "kernel"
    assert make_swapper(caches, 4, "hybrid", ahead="dma").ahead == "dma"
    with pytest.raises(ValueError):
        make_swapper(caches, 4, "kernel", ahead="dma")  # layer-major host tier
    with pytest.raises(ValueError):
        make_swapper(caches, 4, "hybrid", ahead="nvlink")
    monkeypatch.setenv("PENSIEVE_SWAP_AHEAD", "dma")
    assert make_swapper(caches, 4, "staged").ahead == "dma"
    assert make_swapper(caches, 4, "dma").ahead == "kernel"  # where it applies only


def _fails(seeds: range, method: str = "kernel") -> int:
    failed = 0
    for seed in seeds:
        try:
            simulate(seed, method=method)
        except AssertionError:
            failed += 1
    return failed


def test_simulator_catches_a_staging_half_reused_too_early(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Hybrid: a gather into a half that does not wait for the copies out of it overwrites
    chunks not yet copied to the host."""
    monkeypatch.setattr(KVSwapper, "_wait_half_free", lambda self, st, stream, h: None)
    assert _fails(range(60), "hybrid") > 0


def test_simulator_catches_missing_cross_stream_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulation is sharp enough: without the hazard waits some seeds go wrong."""
    monkeypatch.setattr(swapper_mod, "step_waits", lambda plan, busy: StepWaits(-1, False))
    assert _fails(range(60)) > 0
    assert _fails(range(60), "hybrid") > 0


def test_simulator_catches_a_missing_wait_for_swap_ins_ahead(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the next step's wait the compute reads blocks still being swapped in ahead."""
    monkeypatch.setattr(KVSwapper, "_wait_ahead", lambda self: None)
    assert _fails(range(60)) > 0
    assert _fails(range(60), "staged") > 0


def test_simulator_catches_an_undercounted_end_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reporting batches done too early lets the compute stream overwrite their sources."""
    def pop_all(fifo: deque[Any], done: Callable[[Any], bool]) -> int:
        fifo.clear()
        return 0

    monkeypatch.setattr(swapper_mod, "pop_completed", pop_all)
    assert _fails(range(60)) > 0
    assert _fails(range(60), "hybrid") > 0


@pytest.mark.parametrize("method", STREAM_METHODS)
def test_simulated_background_batches_stay_in_flight_across_steps(method: str) -> None:
    """A stalled out stream: counts grow one per step with a swap-out, and a later swap-in of
    a CPU block still being written waits for that batch."""
    sim = SimStreams(random.Random(0), eagerness=0.0)  # nothing runs unless waited for
    caches = list(torch.stack(make_caches(2, 8, 2, 1, 4, torch.float32)).unbind(0))
    sw = make_swapper(caches, 8, method, streams=sim, staging_chunks=1)
    sw._triton = False
    gpu, cpu = snapshot(sw)
    plans = [SwapPlan(swap_out=[(0, 0), (1, 1)]), SwapPlan(swap_out=[(2, 2)]),
             SwapPlan(swap_in=[(1, 5)]), SwapPlan()]
    counts = []
    for plan in plans:
        sw.start_step(plan)
        counts.append(sw.end_step())
        apply_reference(gpu, cpu, plan)
    # step 3's swap-in of CPU block 1 forced batch 0 (and only it) through
    assert counts == [1, 2, 1, 1]
    assert sw.swap_outs_in_flight == 1
    sw.finish_step()
    assert sw.end_step() == 0
    assert_tiers(sw, gpu, cpu)


@pytest.mark.parametrize("method", STREAM_METHODS)
def test_simulated_background_false_waits_at_end_step(method: str) -> None:
    sim = SimStreams(random.Random(0), eagerness=0.0)
    sw = make_swapper(make_caches(2, 8, 2, 1, 4, torch.float32), 8, method, streams=sim,
                      background=False)
    sw._triton = False
    gpu, cpu = snapshot(sw)
    plan = SwapPlan(swap_out=[(0, 3)])
    sw.start_step(plan)
    assert sw.end_step() == 0
    apply_reference(gpu, cpu, plan)
    assert_tiers(sw, gpu, cpu)


# ---------------------------------------------------------------- CUDA: background swap-outs


def stacked_swapper(layers: int = 4, blocks: int = 256, method: str = "kernel",
                    **kw: Any) -> KVSwapper:
    """The engine's layout: per-layer views of one allocation (one launch for all layers)."""
    from pensieve.runner.model_runner import allocate_kv_caches

    caches = allocate_kv_caches(layers, blocks, 32, 8, 128, torch.float16, torch.device("cuda"))
    for c in caches:
        c.copy_(torch.randn(c.shape, device="cuda").half())
    if method != "kernel":
        kw.setdefault("staging_chunks", 16)
    sw = make_swapper(caches, blocks, method, **kw)
    torch.cuda.synchronize()
    return sw


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_default_is_hybrid_on_one_allocation() -> None:
    """On CUDA the default method is `hybrid` (the kernel for swap-ins, gathers and the copy
    engines for background swap-outs); the engine's caches are views of one allocation."""
    sw = stacked_swapper(layers=2, blocks=8)
    assert sw.method == "kernel" and sw._gpu_stack is not None
    assert KVSwapper(make_caches(device="cuda"), 4).method == "hybrid"


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.gpu
@pytest.mark.parametrize("method", STREAM_METHODS)
def test_cuda_background_swap_out_outlives_its_step(method: str) -> None:
    """end_step does not wait for a background batch (here held back by a stalled compute
    stream); a later swap-in of its CPU blocks waits for it; counts fall to 0 once done."""
    sw = stacked_swapper(method=method)
    gpu_src = random.Random(0).sample(range(256), 64)
    cpu = random.Random(1).sample(range(256), 64)
    original = [g[:, gpu_src].clone() for g in sw.gpu_caches]
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    assert sw.start_step(SwapPlan(swap_out=list(zip(gpu_src, cpu, strict=True)))) is None
    t0 = time.perf_counter()
    assert sw.end_step() == 1
    assert time.perf_counter() - t0 < 0.005  # did not wait for the ~25 ms stall
    # next step: the same CPU blocks come back into other GPU blocks
    dst = [g for g in range(256) if g not in gpu_src][:64]
    ready = sw.start_step(SwapPlan(swap_in=list(zip(cpu, dst, strict=True))))
    assert ready is not None
    didx = torch.tensor(dst, device="cuda")
    reads = []
    for layer, g in enumerate(sw.gpu_caches):
        ready(layer)
        reads.append(g.index_select(1, didx))
    torch.cuda.current_stream().synchronize()
    assert sw.end_step() == 0  # the swap-in waited for the batch, so it is done too
    for layer, r in enumerate(reads):
        assert torch.equal(r, original[layer]), f"layer {layer}"


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.gpu
@pytest.mark.parametrize("method", STREAM_METHODS)
def test_cuda_end_step_counts_batches_in_plan_order(method: str) -> None:
    sw = stacked_swapper(method=method)
    torch.cuda.synchronize()
    torch.cuda._sleep(4 * SLEEP_CYCLES)
    counts = []
    for i in range(3):
        sw.start_step(SwapPlan(swap_out=[(10 * i + j, 10 * i + j) for j in range(8)]))
        counts.append(sw.end_step())
    assert counts == [1, 2, 3]
    torch.cuda.synchronize()
    assert sw.end_step() == 0


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.gpu
@pytest.mark.parametrize("method", STREAM_METHODS)
def test_cuda_background_false_waits(method: str) -> None:
    sw = stacked_swapper(method=method, background=False)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    sw.start_step(SwapPlan(swap_out=[(3, 4)]))
    assert sw.end_step() == 0
    assert torch.equal(sw.cpu_caches[0][:, 4], sw.gpu_caches[0][:, 3].cpu())


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.gpu
@pytest.mark.parametrize("method", STREAM_METHODS)
def test_cuda_urgent_swap_out_waits_for_a_background_write_to_its_cpu_block(method: str) -> None:
    """CPU block 5 is written by a held-back background batch, then (freed and reused) by
    the next step's urgent swap-out: the later write must win."""
    sw = stacked_swapper(method=method)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    sw.start_step(SwapPlan(swap_out=[(1, 5), (2, 6)]))
    assert sw.end_step() == 1
    ready = sw.start_step(SwapPlan(swap_out_first=[(9, 5)]))
    assert ready is not None
    sw.finish_step()
    for layer in range(sw.num_layers):
        assert torch.equal(sw.cpu_caches[layer][:, 5], sw.gpu_caches[layer][:, 9].cpu())
        assert torch.equal(sw.cpu_caches[layer][:, 6], sw.gpu_caches[layer][:, 2].cpu())


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.gpu
@pytest.mark.parametrize("method", STREAM_METHODS)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("stacked", [True, False])
def test_cuda_random_steps_with_batches_in_flight(seed: int, stacked: bool,
                                                   method: str) -> None:
    """Random plans over small pools (blocks collide), end_step between steps (batches stay
    in flight), the compute stream stalled at random; swapped-in blocks read at layer_ready."""
    rng = random.Random(seed)
    layers, g_blocks, c_blocks = 3, 48, 40
    caches = make_caches(layers, g_blocks, 32, 8, 128, torch.float16, "cuda")
    if stacked:
        caches = list(torch.stack(caches).unbind(0))
    sw = make_swapper(caches, c_blocks, method)
    assert (sw._gpu_stack is not None) == stacked
    torch.cuda.synchronize()
    gpu, cpu = snapshot(sw)
    for step in range(8):
        lists = []
        for _ in range(3):
            n = rng.choice([0, 2, 5, 11])
            lists.append(list(zip(rng.sample(range(g_blocks), n), rng.sample(range(c_blocks), n),
                                  strict=True)))
        plan = SwapPlan(swap_out_first=lists[0], swap_in=[(c, g) for g, c in lists[1]],
                        swap_out=lists[2])
        if rng.random() < 0.5:
            torch.cuda._sleep(SLEEP_CYCLES // 4)
        ready = sw.start_step(plan)
        dst = [g for _, g in plan.swap_in]
        reads = []
        for layer, g in enumerate(sw.gpu_caches):
            if ready is not None:
                ready(layer)
            reads.append(g[:, dst].clone())
        torch.cuda.current_stream().synchronize()
        sw.end_step()
        apply_reference(gpu, cpu, SwapPlan(swap_out_first=plan.swap_out_first,
                                           swap_in=plan.swap_in))
        for layer in range(layers):
            assert torch.equal(reads[layer].cpu(), gpu[layer][:, dst]), f"{step=} {layer=}"
        apply_reference(gpu, cpu, SwapPlan(swap_out=plan.swap_out))
    sw.finish_step()
    assert sw.end_step() == 0
    assert_tiers(sw, gpu, cpu)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.gpu
@pytest.mark.parametrize("method", ["hybrid", "staged"])
def test_cuda_staging_halves_reused_by_batches_in_flight(method: str) -> None:
    """Three background batches of 20 chunks (3 pieces of at most 8 each through two halves)
    held in flight across steps by a stalled compute stream, then every chunk swapped back
    in (that waits for them); the CPU tier is chunk-major and pinned."""
    sw = stacked_swapper(method=method, staging_chunks=8)
    assert sw.host_layout == "chunk-major" and sw.pinned
    assert sw.host_tier.is_pinned() and all(c.is_pinned() for c in sw.cpu_caches)
    rng = random.Random(0)
    src = rng.sample(range(128), 60)
    cpu = rng.sample(range(256), 60)
    original = [g[:, src].clone() for g in sw.gpu_caches]
    torch.cuda.synchronize()
    torch.cuda._sleep(4 * SLEEP_CYCLES)
    counts = []
    for i in range(3):
        part = slice(20 * i, 20 * i + 20)
        sw.start_step(SwapPlan(swap_out=list(zip(src[part], cpu[part], strict=True))))
        counts.append(sw.end_step())
    assert counts == [1, 2, 3]
    assert all(t.shape[0] == 8 for t in sw._out_stage)
    dst = list(range(128, 188))
    ready = sw.start_step(SwapPlan(swap_in=list(zip(cpu, dst, strict=True))))
    assert ready is not None
    didx = torch.tensor(dst, device="cuda")
    reads = []
    for layer, g in enumerate(sw.gpu_caches):
        ready(layer)
        reads.append(g.index_select(1, didx))
    torch.cuda.current_stream().synchronize()
    assert sw.end_step() == 0
    for layer, r in enumerate(reads):
        assert torch.equal(r, original[layer]), f"layer {layer}"
        assert torch.equal(sw.cpu_caches[layer][:, cpu], original[layer].cpu())


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_staging_grows_while_batches_are_in_flight() -> None:
    """A small batch, then a larger one (the halves are replaced while the first batch still
    uses the old ones), both held back by a stalled compute stream."""
    sw = stacked_swapper(method="hybrid", staging_chunks=32)
    gpu, cpu = snapshot(sw)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    plans = [SwapPlan(swap_out=[(3, 7), (4, 9)]),
             SwapPlan(swap_out=list(zip(range(10, 50), range(100, 140), strict=True)))]
    for plan in plans:
        sw.start_step(plan)
        sw.end_step()
        apply_reference(gpu, cpu, plan)
    assert sw.swap_outs_in_flight >= 1
    sw.finish_step()
    assert_tiers(sw, gpu, cpu)


def test_kernel_knobs_between_steps() -> None:
    """num_programs and tile_bytes change the launches, not the result."""
    rng = random.Random(3)
    caches = list(torch.stack(make_caches(3, 20, 4, 2, 8)).unbind(0))
    sw = make_swapper(caches, 16, "kernel", num_programs=2)
    gpu, cpu = snapshot(sw)
    for programs, tile in ((2, None), (5, 32), (64, 8)):
        sw.num_programs, sw.tile_bytes = programs, tile
        g = rng.sample(range(20), 6)
        c = rng.sample(range(16), 6)
        plan = SwapPlan(swap_in=list(zip(c[:3], g[:3], strict=True)),
                        swap_out=list(zip(g[3:], c[3:], strict=True)))
        run_step(sw, plan)
        apply_reference(gpu, cpu, plan)
        assert_tiers(sw, gpu, cpu)
    assert sw._copies and all(c.num_programs == 64 for spans in sw._copies.values()
                              for _, _, c in spans)
    with pytest.raises(ValueError):
        sw.num_programs = 0
