"""KVSwapper: the CPU tier and the step's swap copies, against a block-by-block reference.

The reference applies a SwapPlan one pair at a time, in the documented order
(swap_out_first, swap_in, swap_out). Every test runs on the CPU (the engine's CPU path: no
streams, swap-ins at ``layer_ready``); the ``cuda`` cases run the same plans on the GPU and add
races that only the copy stream's events prevent (the compute stream is stalled with
``torch.cuda._sleep`` so that a missing wait reads or writes too early).
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from pensieve.core.outputs import SwapPlan
from pensieve.runner.swapper import KVSwapper

HAS_CUDA = torch.cuda.is_available()
cuda = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]
DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def make_caches(
    layers: int = 3, blocks: int = 24, chunk: int = 4, heads: int = 2, dim: int = 8,
    dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
) -> list[torch.Tensor]:
    return [torch.randn(2, blocks, chunk, heads, dim, dtype=dtype, device=device)
            for _ in range(layers)]


def make_swapper(caches: list[torch.Tensor], cpu_blocks: int) -> KVSwapper:
    sw = KVSwapper(caches, cpu_blocks)
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
        for c, g in plan.swap_in:
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
@pytest.mark.parametrize("cpu_pattern", PATTERNS)
@pytest.mark.parametrize("gpu_pattern", PATTERNS)
@pytest.mark.parametrize("chunk,layers,dtype", [(4, 2, torch.bfloat16), (8, 3, torch.float32)])
def test_round_trip_restores_bytes_in_other_blocks(
    device: str, cpu_pattern: str, gpu_pattern: str, chunk: int, layers: int, dtype: torch.dtype
) -> None:
    rng = random.Random(f"{cpu_pattern}{gpu_pattern}{chunk}")
    sw = make_swapper(make_caches(layers, 40, chunk, dtype=dtype, device=device), 32)
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
@pytest.mark.parametrize("seed", range(6))
def test_random_plans_match_reference(device: str, seed: int) -> None:
    """Several steps of random plans; the lists may share blocks (order decides the result)."""
    rng = random.Random(seed)
    gpu_blocks, cpu_blocks = 48, 40
    sw = make_swapper(make_caches(3, gpu_blocks, 4, device=device), cpu_blocks)
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
def test_swap_out_first_then_swap_in_into_the_same_gpu_block(device: str) -> None:
    """An urgent eviction frees GPU block 5 for a swap-in in the same step."""
    sw = make_swapper(make_caches(device=device), 8)
    old = [g[:, 5].cpu().clone() for g in sw.gpu_caches]
    new = [c[:, 6].clone() for c in sw.cpu_caches]
    run_step(sw, SwapPlan(swap_out_first=[(5, 2)], swap_in=[(6, 5)]))
    for layer in range(sw.num_layers):
        assert torch.equal(sw.cpu_caches[layer][:, 2], old[layer])
        assert torch.equal(sw.gpu_caches[layer][:, 5].cpu(), new[layer])


@pytest.mark.parametrize("device", DEVICES)
def test_swap_in_reads_a_cpu_block_before_swap_out_overwrites_it(device: str) -> None:
    sw = make_swapper(make_caches(device=device), 8)
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
def test_invalid_plans_are_rejected(plan: SwapPlan) -> None:
    sw = make_swapper(make_caches(), 8)
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
