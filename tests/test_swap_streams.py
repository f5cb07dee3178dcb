"""KVSwapper's stream ordering, simulated on the CPU and run on the GPU.

The stream ordering of the staged method (copy streams, background swap-outs outliving their
step: gathers into two staging halves on the out stream, device-to-host copies on the dma
stream; swap-ins by groups of layers through the in-staging buffer) is checked on the CPU by
running the swapper's real issue logic against a simulator of streams and events
(:class:`SimStreams`) that executes the enqueued work in random orders that respect only the
waits the swapper asked for; the simulator is first shown to catch a missing wait (a hazard
wait, a staging half reused too early). The staged method runs with a few chunks per staging
piece, so batches are cut into several pieces and both halves are reused. The ``cuda`` cases run
background batches, staging halves and random multi-step plans on the GPU.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import pytest
import torch
from swap_util import (
    HAS_CUDA,
    SLEEP_CYCLES,
    STREAM_METHODS,
    _seed,  # noqa: F401  (the autouse fixture)
    apply_reference,
    assert_tiers,
    make_caches,
    make_swapper,
    new_swapper,
    run_step,
    snapshot,
)

from pensieve.core.outputs import SwapPlan
from pensieve.runner import swap_staged
from pensieve.runner import swapper as swapper_mod
from pensieve.runner.swapper import (
    KVSwapper,
    StepWaits,
)

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
        self.in_dma_stream = "indma"
        self.queues: dict[str, deque[tuple[str, Any]]] = {
            "in": deque(), "out": deque(), "dma": deque(), "indma": deque(),
            "compute": deque()}
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


def simulate(seed: int, steps: int = 8, method: str = "staged", ahead: bool = True,
             ahead_waits: str = "all", defer: bool = False, layers: int = 2,
             out_groups: int = 1) -> None:
    """Random plans over small pools (blocks collide often) on the staged method's stream
    logic, with a compute stream that reads each layer's swapped-in blocks after
    ``layer_ready`` and writes blocks the step owns: the urgent swap-outs' sources (reused),
    the swap-ins' destinations (new tokens) and free ones, never a block a background batch
    reported in flight may still read (the contract of ``end_step``'s count). Checks the
    reads, the counts and both tiers against the sequential reference. With ``ahead``, plans
    also carry ``swap_in_ahead`` copies, read by the next step's compute (their CPU blocks left
    alone for two steps, as the cache does). ``defer``: the background copies (ahead and
    background swap-outs) issued after the step's compute, as the runner does with
    ``defer_background``. ``out_groups``: background swap-outs gathered and copied by that
    many groups of ``layers`` layers (the swapper's default is 8)."""
    rng = random.Random(seed)
    g_blocks, c_blocks = 14, 12
    caches = list(torch.stack(make_caches(layers, g_blocks, 2, 1, 4, torch.float32)).unbind(0))
    sim = SimStreams(rng, eagerness=rng.choice([0.2, 0.5, 0.8]))
    sw = make_swapper(caches, c_blocks, method, streams=sim, staging_chunks=1,
                      ahead_waits=ahead_waits, out_groups=out_groups)
    sw.kernels.triton = False  # the torch reference of the kernel: the streams are under test
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
        ready = sw.start_step(plan, defer_background=defer)
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
        sw.issue_background()  # (no-op unless deferred) once the forward is issued
        if plan.swap_out:
            out_events.append(sw._in_flight[-1].event)
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


@pytest.mark.parametrize("seed", range(40))
def test_simulated_ahead_copies_waited_for_by_layers(seed: int) -> None:
    """``ahead_waits="layers"``: the ahead copies go by groups of layers, and the next step's
    layer i waits for its group only (also when the step has no copies of its own); it still
    reads them done, its writes and swap-outs land after them, and the tiers end as the
    sequential reference's."""
    simulate(seed, ahead_waits="layers")


@pytest.mark.parametrize("ahead_waits", ["all", "layers"])
@pytest.mark.parametrize("seed", range(40))
def test_simulated_background_copies_issued_after_the_compute(seed: int,
                                                              ahead_waits: str) -> None:
    """``defer_background``: the ahead copies and background swap-outs issued once the
    step's compute is (``issue_background``) wait for the same events as when issued first:
    the reads, the counts and the tiers match the sequential reference."""
    simulate(seed, ahead_waits=ahead_waits, defer=True)


@pytest.mark.parametrize(("layers", "groups"), [(3, 2), (3, 3), (5, 2)])
@pytest.mark.parametrize("seed", range(30))
def test_simulated_swap_outs_by_groups_of_layers(seed: int, layers: int, groups: int) -> None:
    """Background swap-outs by groups of layers (each group's copies to the host after its
    own gather, a staging half packed by group): reads, counts and tiers still match the
    sequential reference."""
    simulate(seed, layers=layers, out_groups=groups)


def test_simulator_catches_a_group_copied_before_its_gather(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """By groups: a group's copies to the host that do not wait for its gather copy stale
    staging rows."""
    real = swap_staged.StagedCopies.issue_out

    def no_wait(self: Any, st: Any, pairs: Any, gather: Any, dma: Any) -> Any:
        wait = st.wait
        st.wait = lambda stream, event: None if stream is dma else wait(stream, event)
        try:
            return real(self, st, pairs, gather, dma)
        finally:
            st.wait = wait

    monkeypatch.setattr(swap_staged.StagedCopies, "issue_out", no_wait)
    failed = 0
    for seed in range(40):
        try:
            simulate(seed, method="staged", layers=3, out_groups=3)
        except AssertionError:
            failed += 1
    assert failed > 0


def test_out_groups_default_at_most_one_per_layer() -> None:
    for layers, groups in ((3, 3), (9, 8)):
        sw = make_swapper(make_caches(layers, 8, 2, 1, 4, torch.float32), 8, "staged")
        assert sw.staged is not None and sw.staged.out_groups == groups


def test_deferred_background_copies_are_issued_by_end_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller that never calls ``issue_background`` still gets the copies: ``end_step``
    issues them; ``issue_background`` twice issues them once; the tiers end as the sequential
    reference's."""
    calls = []
    issue = KVSwapper._issue_background

    def counting(self: KVSwapper, *args: Any) -> None:
        calls.append(1)
        issue(self, *args)

    monkeypatch.setattr(KVSwapper, "_issue_background", counting)
    sim = SimStreams(random.Random(0), eagerness=0.0)
    sw = make_swapper(make_caches(2, 8, 2, 1, 4, torch.float32), 8, "staged", streams=sim)
    sw.kernels.triton = False
    gpu, cpu = snapshot(sw)
    first = SwapPlan(swap_in=[(0, 1)], swap_out=[(2, 3)], swap_in_ahead=[(4, 5)])
    sw.start_step(first, defer_background=True)
    assert not calls and not sw._in_flight and not sw._ahead  # held back
    sw.end_step()
    assert len(calls) == 1
    second = SwapPlan(swap_out=[(6, 7)])
    sw.start_step(second, defer_background=True)
    sw.issue_background()
    sw.issue_background()
    assert len(calls) == 2
    sw.finish_step()
    sim.drain()
    for plan in (first, second):
        apply_reference(gpu, cpu, plan)
    assert_tiers(sw, gpu, cpu)


def test_simulator_catches_ahead_copies_not_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulation is sharp enough: a step whose layers do not wait for the previous
    step's ahead copies reads some of them not yet done."""
    def no_wait(self: KVSwapper) -> None:
        return None

    monkeypatch.setattr(KVSwapper, "_wait_ahead", no_wait)
    assert _fails(range(40), "staged", ahead_waits="layers") > 0


def test_ahead_waits_choice() -> None:
    caches = make_caches(2, 4, 2, 1, 4, torch.float32)
    assert make_swapper(caches, 4, "staged").ahead_waits == "layers"  # the default
    assert make_swapper(caches, 4, "dma").ahead_waits == "all"  # where it does not apply
    assert make_swapper(caches, 4, "staged", ahead_waits="all").ahead_waits == "all"
    assert make_swapper(caches, 4, "staged", ahead_waits="layers").ahead_waits == "layers"
    with pytest.raises(ValueError, match="ahead waits 'layers'"):  # no streams
        make_swapper(caches, 4, "dma", ahead_waits="layers")
    with pytest.raises(ValueError, match="not in"):
        make_swapper(caches, 4, "staged", ahead_waits="some")


@pytest.mark.parametrize("method", STREAM_METHODS)
def test_swap_ins_ahead_counted_and_validated_on_streams(method: str) -> None:
    """Ahead copies count in ``bytes_in`` and bad block ids in them are refused, as for the
    step's own swap-ins."""
    sim = SimStreams(random.Random(0), eagerness=0.0)
    sw = make_swapper(make_caches(2, 8, 2, 1, 4, torch.float32), 8, method, streams=sim)
    sw.kernels.triton = False
    sw.start_step(SwapPlan(swap_in=[(0, 1)], swap_in_ahead=[(2, 3), (4, 5)]))
    assert sw.bytes_in == 3 * sw.chunk_bytes
    sw.finish_step()
    with pytest.raises(ValueError):
        sw.start_step(SwapPlan(swap_in_ahead=[(0, 99)]))


def _fails(seeds: range, method: str = "staged", **kw: Any) -> int:
    failed = 0
    for seed in seeds:
        try:
            simulate(seed, method=method, **kw)
        except AssertionError:
            failed += 1
    return failed


def test_simulator_catches_a_staging_half_reused_too_early(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A gather into a half that does not wait for the copies out of it overwrites
    chunks not yet copied to the host."""
    monkeypatch.setattr(swap_staged.StagedCopies, "_wait_half_free",
                        lambda self, st, stream, h: None)
    assert _fails(range(60)) > 0


def test_simulator_catches_an_in_staging_half_reused_too_early(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Staged swap-ins by groups: copies into a half that do not wait for the scatter out of
    it overwrite chunks not yet scattered."""
    monkeypatch.setattr(swap_staged.StagedCopies, "_wait_in_half",
                        staticmethod(lambda st, dma, free: None))
    assert _fails(range(60)) > 0


def test_simulator_catches_missing_cross_stream_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulation is sharp enough: without the hazard waits some seeds go wrong."""
    monkeypatch.setattr(swapper_mod, "step_waits", lambda plan, busy: StepWaits(-1, False))
    assert _fails(range(60)) > 0


def test_simulator_catches_a_missing_wait_for_swap_ins_ahead(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the next step's wait the compute reads blocks still being swapped in ahead."""
    monkeypatch.setattr(KVSwapper, "_wait_ahead", lambda self: None)
    assert _fails(range(60)) > 0
    assert _fails(range(60), ahead_waits="layers") > 0


def test_simulator_catches_an_undercounted_end_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reporting batches done too early lets the compute stream overwrite their sources."""
    def pop_all(fifo: deque[Any], done: Callable[[Any], bool]) -> int:
        fifo.clear()
        return 0

    monkeypatch.setattr(swapper_mod, "pop_completed", pop_all)
    assert _fails(range(60)) > 0


@pytest.mark.parametrize("method", STREAM_METHODS)
def test_simulated_background_batches_stay_in_flight_across_steps(method: str) -> None:
    """A stalled out stream: counts grow one per step with a swap-out, and a later swap-in of
    a CPU block still being written waits for that batch."""
    sim = SimStreams(random.Random(0), eagerness=0.0)  # nothing runs unless waited for
    caches = list(torch.stack(make_caches(2, 8, 2, 1, 4, torch.float32)).unbind(0))
    sw = make_swapper(caches, 8, method, streams=sim, staging_chunks=1)
    sw.kernels.triton = False
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
    sw.kernels.triton = False
    gpu, cpu = snapshot(sw)
    plan = SwapPlan(swap_out=[(0, 3)])
    sw.start_step(plan)
    assert sw.end_step() == 0
    apply_reference(gpu, cpu, plan)
    assert_tiers(sw, gpu, cpu)


# ---------------------------------------------------------------- CUDA: background swap-outs


def stacked_swapper(layers: int = 4, blocks: int = 256, method: str | None = None,
                    **kw: Any) -> KVSwapper:
    """The engine's layout: per-layer views of one allocation (one launch for all layers)."""
    from pensieve.engine.kv_layout import KVLayout

    caches = KVLayout(layers, 8, 128, 32, torch.float16).allocate(blocks, torch.device("cuda"))
    for c in caches:
        c.copy_(torch.randn(c.shape, device="cuda").half())
    if method != "dma":  # staged, the default on CUDA
        kw.setdefault("staging_chunks", 16)
    sw = make_swapper(caches, blocks, method, **kw)
    torch.cuda.synchronize()
    return sw


def swap_in_and_read(sw: KVSwapper, cpu: list[int], dst: list[int]) -> list[torch.Tensor]:
    """One step swapping CPU blocks ``cpu`` into GPU blocks ``dst``: the compute stream reads
    each layer's ``dst`` blocks after ``layer_ready`` (synchronized; the step is left open)."""
    ready = sw.start_step(SwapPlan(swap_in=list(zip(cpu, dst, strict=True))))
    assert ready is not None
    didx = torch.tensor(dst, device="cuda")
    reads = []
    for layer, g in enumerate(sw.gpu_caches):
        ready(layer)
        reads.append(g.index_select(1, didx))
    torch.cuda.current_stream().synchronize()
    return reads


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_default_is_staged_on_one_allocation() -> None:
    """On CUDA the default method is `staged` (the copy engines both ways, swap-ins by groups
    of layers); the engine's caches are views of one allocation."""
    sw = stacked_swapper(layers=2, blocks=8)
    assert sw.method == "staged" and sw.kernels.gpu_stack is not None
    assert new_swapper(make_caches(device="cuda"), 4).method == "staged"


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
    reads = swap_in_and_read(sw, cpu, dst)
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
def test_cuda_random_steps_with_batches_in_flight(seed: int, stacked: bool, method: str
                                                   ) -> None:
    """Random plans over small pools (blocks collide), end_step between steps (batches stay
    in flight), the compute stream stalled at random; swapped-in blocks read at layer_ready."""
    rng = random.Random(seed)
    layers, g_blocks, c_blocks = 3, 48, 40
    caches = make_caches(layers, g_blocks, 32, 8, 128, torch.float16, "cuda")
    if stacked:
        caches = list(torch.stack(caches).unbind(0))
    sw = make_swapper(caches, c_blocks, method)
    assert (sw.kernels.gpu_stack is not None) == stacked
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
def test_cuda_staging_halves_reused_by_batches_in_flight() -> None:
    """Three background batches of 20 chunks (3 pieces of at most 8 each through two halves)
    held in flight across steps by a stalled compute stream, then every chunk swapped back
    in (that waits for them); the CPU tier is chunk-major and pinned."""
    sw = stacked_swapper(method="staged", staging_chunks=8)
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
    assert all(t.shape[0] == 8 for t in sw.staged.out_stage)
    dst = list(range(128, 188))
    reads = swap_in_and_read(sw, cpu, dst)
    assert sw.end_step() == 0
    for layer, r in enumerate(reads):
        assert torch.equal(r, original[layer]), f"layer {layer}"
        assert torch.equal(sw.cpu_caches[layer][:, cpu], original[layer].cpu())


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_staging_grows_while_batches_are_in_flight() -> None:
    """A small batch, then a larger one (the halves are replaced while the first batch still
    uses the old ones), both held back by a stalled compute stream."""
    sw = stacked_swapper(method="staged", staging_chunks=32)
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
    """num_programs and tile_bytes change the staged method's launches (urgent swap-outs,
    scatters, gathers), not the result."""
    rng = random.Random(3)
    caches = list(torch.stack(make_caches(3, 20, 4, 2, 8)).unbind(0))
    sw = make_swapper(caches, 16, "staged", num_programs=2)
    gpu, cpu = snapshot(sw)
    for programs, tile in ((2, None), (5, 32), (64, 8)):
        sw.num_programs, sw.tile_bytes = programs, tile
        g = rng.sample(range(20), 8)
        c = rng.sample(range(16), 8)
        plan = SwapPlan(swap_out_first=list(zip(g[6:], c[6:], strict=True)),
                        swap_in=list(zip(c[:3], g[:3], strict=True)),
                        swap_out=list(zip(g[3:6], c[3:6], strict=True)))
        run_step(sw, plan)
        apply_reference(gpu, cpu, plan)
        assert_tiers(sw, gpu, cpu)
    launches = sw.kernels.launches
    assert launches and all(c.num_programs == 64 for spans in launches.values()
                            for _, _, c in spans)
    with pytest.raises(ValueError):
        sw.num_programs = 0


@pytest.mark.parametrize("in_groups", [1, 2, 4])
def test_staged_swap_ins_pipelined_by_groups_of_layers(in_groups: int) -> None:
    """A staged step's layer waits for its own group of layers only: once the first group's
    event is done, its layers hold the swapped-in blocks and the later groups' do not yet."""
    caches = list(torch.stack(make_caches(4, 10, 2, 1, 4, torch.float32)).unbind(0))
    sim = SimStreams(random.Random(0), eagerness=0.0)
    sw = make_swapper(caches, 8, "staged", streams=sim, in_groups=in_groups, staging_chunks=2)
    sw.kernels.triton = False
    gpu, cpu = snapshot(sw)
    plan = SwapPlan(swap_in=[(1, 3), (2, 5), (6, 7)])
    ready = sw.start_step(plan)
    assert ready is not None and sw._step is not None and sw._step.events is not None
    events = sw._step.events
    groups = swap_staged.layer_groups(4, in_groups)
    assert len(events) == 4 and len({id(e) for e in events}) == len(groups)
    sim.force(events[0])
    apply_reference(gpu, cpu, plan)
    for layer in range(4):
        here = torch.equal(sw.gpu_caches[layer], gpu[layer])
        assert here == (layer < groups[0][1]), f"layer {layer}"
    for layer in range(4):
        ready(layer)
    sw.finish_step()
    sim.drain()
    assert_tiers(sw, gpu, cpu)


def test_in_groups_choice() -> None:
    caches = make_caches(3, 4, 2, 1, 4, torch.float32)
    assert make_swapper(caches, 4, "staged").in_groups == 3  # at most one group per layer
    assert make_swapper(caches, 4, "staged", in_groups=2).in_groups == 2
    with pytest.raises(ValueError, match="in_groups"):
        make_swapper(caches, 4, "staged", in_groups=0)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(("layers", "in_groups", "staging"), [(3, 2, 1), (5, 2, 1), (4, 4, 2)])
def test_staged_swap_ins_by_halves_and_whole_buffer_pieces(seed: int, layers: int,
                                                           in_groups: int, staging: int) -> None:
    """Groups whose share of the in-staging buffer holds fewer than two chunks use the whole
    buffer (one piece on the in stream); the others its two halves in turn (copies on the
    in-dma stream). Mixed in one step and across steps, in random stream orders, the tiers
    match the reference, and each layer's event covers its own group's swap-ins."""
    rng = random.Random(seed)
    caches = list(torch.stack(make_caches(layers, 16, 2, 1, 4, torch.float32)).unbind(0))
    sim = SimStreams(rng, eagerness=rng.choice([0.0, 0.3, 0.9]))
    sw = make_swapper(caches, 12, "staged", streams=sim, in_groups=in_groups,
                      staging_chunks=staging)
    sw.kernels.triton = False
    groups = swap_staged.layer_groups(layers, in_groups)
    halved = {(a, b) for a, b in groups if staging * layers // (b - a) >= 2}
    # (3, 2, 1): the whole buffer, then halves; (5, 2, 1): halves, then the whole buffer
    assert halved == ({(2, 3)} if layers == 3 else {(0, 2)} if layers == 5 else set(groups))
    gpu, cpu = snapshot(sw)
    for _ in range(3):
        n = rng.randint(1, 5)
        g = rng.sample(range(16), 2 * n)
        c = rng.sample(range(12), 2 * n)
        plan = SwapPlan(swap_in=list(zip(c[:n], g[:n], strict=True)),
                        swap_out=list(zip(g[n:], c[n:], strict=True)))
        ready = sw.start_step(plan)
        assert ready is not None and sw._step is not None and sw._step.events is not None
        events = sw._step.events
        apply_reference(gpu, cpu, plan)
        a, b = groups[0]
        sim.force(events[a])
        for layer in range(a, b):  # the first group's layers hold their swap-ins
            assert torch.equal(sw.gpu_caches[layer][:, g[:n]], gpu[layer][:, g[:n]])
        for layer in range(layers):
            ready(layer)
        sim.synchronize(sim.record(None))
        sw.end_step()
    sw.finish_step()
    sim.drain()
    assert_tiers(sw, gpu, cpu)
