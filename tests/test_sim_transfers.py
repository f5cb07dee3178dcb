"""The simulator's tier-transfer model: rates as measured, swap-ins pipelined with the compute,
urgent swap-outs exposed, background swap-outs that outlive their step (reported as
``RunnerOutput.swap_outs_in_flight`` so the cache reclaims their GPU blocks only when the
simulated copy is done), per-step records, and compatibility with existing step-cost files."""

from __future__ import annotations

import dataclasses
import gzip
import importlib
import json
import random
from pathlib import Path

import pytest

from pensieve.bench.engine_api import VirtualClock
from pensieve.core.conversation import Tier
from pensieve.core.cost_model import CostModel
from pensieve.core.outputs import QueryRange, ScheduledRequest, SchedulerOutput, SwapPlan
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.scheduling_config import SchedulerConfig
from pensieve.sim.simulator import DEFAULT_TRANSFER, SimEngine, prefill_decode_tokens
from pensieve.sim.step_cost import (
    PREFERRED_CASES,
    StepCostModel,
    StepFeatures,
    TransferModel,
    TransferTimeline,
    features_of,
    relative_errors,
)

ROOT = Path(__file__).resolve().parent.parent
BB = 32 * 2 * 40 * 10 * 128 * 2  # Llama 2-13B GQA chunk, all layers, K+V, bf16: 6.55 MB


def pairs(n: int, gpu0: int = 0, cpu0: int = 0) -> list[tuple[int, int]]:
    return [(gpu0 + i, cpu0 + i) for i in range(n)]


# ------------------------------------------------------------------------ TransferModel


def test_model_defaults_and_validation() -> None:
    m = TransferModel()
    assert m.swap_in_gbps == m.swap_out_gbps == 45.0 and m.latency_s == 0.0
    assert m.in_seconds(45e9) == pytest.approx(1.0) and m.out_seconds(4.5e9) == 0.1
    assert DEFAULT_TRANSFER.swap_in_gbps == 45.0
    for bad in ({"swap_in_gbps": 0}, {"swap_out_gbps": -1}, {"swap_in_gbps": float("inf")},
                {"latency_s": -1e-3}, {"num_layers": 0}, {"num_layers": 2.5}):
        with pytest.raises(ValueError):
            TransferModel(**bad)  # type: ignore[arg-type]


def test_swap_in_exposed_only_beyond_compute() -> None:
    """Layer i's attention waits for layer i's copies only: exposed = latency + max(T/L,
    T - C + C/L); continuous (L = None): latency + max(0, T - C); unpipelined: latency + T."""
    lat = 1e-3
    for n_layers in (None, 1, 4, 40):
        m = TransferModel(latency_s=lat, num_layers=n_layers)
        for t, c in ((0.010, 0.050), (0.050, 0.010), (0.030, 0.030)):
            end = m.swap_in_finish(0.0, 0.0, t, c)
            if n_layers is None:
                want = lat + max(0.0, t - c)
            else:
                want = lat + max(t / n_layers, t - c + c / n_layers)
            assert end - c == pytest.approx(want), (n_layers, t, c)
    # one layer: no overlap at all; unpipelined: the same, whatever the layers
    assert TransferModel(num_layers=1).swap_in_finish(0, 0, 0.02, 0.05) == pytest.approx(0.07)
    assert TransferModel(pipelined=False, num_layers=40).swap_in_finish(
        0, 0, 0.02, 0.05) == pytest.approx(0.07)
    # nothing to copy: the compute alone, no latency
    assert TransferModel(latency_s=1.0).swap_in_finish(0, 0, 0.0, 0.05) == 0.05


def test_load_measured_json(tmp_path: Path) -> None:
    path = ROOT / "tests" / "data" / "swap_bandwidth_cases.json"  # the older case-row format
    rows = json.loads(path.read_text())["rows"]
    m = TransferModel.load(path)
    present = {r["case"] for r in rows}
    case = next(c for c in PREFERRED_CASES if c in present)
    for direction, got in (("in", m.swap_in_gbps), ("out", m.swap_out_gbps)):
        sel = [r for r in rows if r["case"] == case and r["dir"] == direction]
        assert got == pytest.approx(sum(r["bytes"] for r in sel) / sum(r["s"] for r in sel)
                                    / 1e9)
    assert f"[{case}]" in m.source
    direct = TransferModel.load(path, case="direct", latency_s=2e-4, num_layers=40)
    assert 40 < direct.swap_in_gbps < 56 and direct.latency_s == 2e-4
    assert direct.num_layers == 40
    with pytest.raises(ValueError, match="no 'in' rows"):
        TransferModel.load(path, case="bogus")
    # explicit rates, and the model's own format
    p = tmp_path / "rates.json"
    p.write_text(json.dumps({"swap_in_gbps": 30, "swap_out_gbps": 20, "latency_s": 1e-4}))
    r = TransferModel.load(p)
    assert (r.swap_in_gbps, r.swap_out_gbps, r.latency_s) == (30.0, 20.0, 1e-4)
    saved = tmp_path / "transfer.json"
    TransferModel(swap_in_gbps=12, num_layers=8, pipelined=False).save(saved)
    assert TransferModel.load(saved) == TransferModel(swap_in_gbps=12, num_layers=8,
                                                      pipelined=False)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError):
        TransferModel.load(bad)


def test_load_kernel_benchmark_rows(tmp_path: Path) -> None:
    """The swap kernel's benchmark writes ``method`` and ``pattern`` per row: by default the
    kernel's rows of random block ids, one-way directions only, byte-weighted."""
    def row(method: str, pattern: str | None, d: str, chunks: int, gbps: float) -> dict:
        nbytes = chunks * BB
        r = {"method": method, "dir": d, "chunks": chunks, "bytes": nbytes,
             "s": nbytes / (gbps * 1e9)}
        if pattern is not None:
            r["pattern"] = pattern
        return r

    rows = [row("raw", None, "in", 0, 55.0), row("raw", None, "out", 0, 55.0),
            row("kernel", "random", "in", 64, 40.0), row("kernel", "random", "in", 1024, 46.0),
            row("kernel", "random", "out", 64, 42.0), row("kernel", "random", "in+out", 64, 30),
            row("kernel", "random", "out", 1024, 48.0), row("kernel", "direct", "in", 64, 50.0),
            row("kernel", "direct", "out", 64, 50.0), row("dma", "random", "in", 64, 8.0),
            row("dma", "random", "out", 64, 8.5)]
    p = tmp_path / "swap_bandwidth.json"
    p.write_text(json.dumps({"rows": rows, "sweep": []}))
    m = TransferModel.load(p)
    want_in = (64 + 1024) * BB / (64 * BB / 40e9 + 1024 * BB / 46e9) / 1e9
    want_out = (64 + 1024) * BB / (64 * BB / 42e9 + 1024 * BB / 48e9) / 1e9
    assert m.swap_in_gbps == pytest.approx(want_in) and m.swap_out_gbps == pytest.approx(want_out)
    assert m.source.endswith("[kernel, random]")
    dma = TransferModel.load(p, case="dma")
    assert (dma.swap_in_gbps, dma.swap_out_gbps) == (pytest.approx(8.0), pytest.approx(8.5))
    direct = TransferModel.load(p, pattern="direct", num_layers=40)
    assert direct.swap_in_gbps == pytest.approx(50.0) and direct.num_layers == 40
    with pytest.raises(ValueError, match="method 'kernel', pattern 'scattered'"):
        TransferModel.load(p, pattern="scattered")


# ------------------------------------------------------------------------ TransferTimeline


def test_background_swap_out_completes_after_its_transfer_time() -> None:
    """A background batch of n chunks at 45 GB/s takes n * BB / 45e9 s from the step's start,
    is not waited for, and stays in flight over every step that ends before it is done."""
    tl = TransferTimeline(TransferModel(), BB)
    n = 256  # 1.68 GB: 37.3 ms
    copy_s = n * BB / 45e9
    r = tl.step(10.0, SwapPlan(swap_out=pairs(n)), compute_s=0.005)
    assert r.step_s == pytest.approx(0.005) and r.exposed_copy_s == 0.0
    assert r.swap_outs_in_flight == 1
    assert r.background_done_at == pytest.approx(10.0 + copy_s)
    t = 10.005
    counts = []
    while t < 10.0 + copy_s + 0.02:
        counts.append((t, tl.step(t, SwapPlan(), compute_s=0.005).swap_outs_in_flight))
        t += 0.005
    for start, k in counts:
        assert k == (1 if start + 0.005 < 10.0 + copy_s else 0), (start, k)
    assert tl.in_flight == deque_empty()


def deque_empty() -> object:
    from collections import deque

    return deque()


def test_background_batches_queue_in_plan_order() -> None:
    tl = TransferTimeline(TransferModel(swap_out_gbps=10.0), BB)
    one = BB / 10e9
    a = tl.step(0.0, SwapPlan(swap_out=pairs(10)), 0.001)
    b = tl.step(0.001, SwapPlan(swap_out=pairs(10, 100, 100)), 0.001)
    assert a.background_done_at == pytest.approx(10 * one)
    assert b.background_done_at == pytest.approx(20 * one)  # behind the first: one stream
    assert b.swap_outs_in_flight == 2
    idle = tl.step(10 * one + 1e-9, SwapPlan(), 0.001)
    assert idle.swap_outs_in_flight == 1 and tl.next_done_at == pytest.approx(20 * one)


def test_swap_in_runs_beside_background_and_is_exposed_beyond_compute() -> None:
    m = TransferModel(latency_s=1e-4)
    tl = TransferTimeline(m, BB)
    t_in = 64 * BB / 45e9  # 9.3 ms
    # swap-ins shorter than the compute: only the latency shows
    r = tl.step(0.0, SwapPlan(swap_in=pairs(64), swap_out=pairs(64, 100, 100)), 0.020)
    assert r.exposed_copy_s == pytest.approx(1e-4)
    assert r.background_done_at == pytest.approx(1e-4 + 64 * BB / 45e9)  # full duplex
    # longer than the compute: the rest shows
    tl2 = TransferTimeline(m, BB)
    r2 = tl2.step(0.0, SwapPlan(swap_in=pairs(64)), 0.004)
    assert r2.exposed_copy_s == pytest.approx(1e-4 + t_in - 0.004)
    assert r2.step_s == pytest.approx(0.004 + r2.exposed_copy_s)


def test_swap_ins_ahead_overlap_their_step_and_delay_the_next_compute() -> None:
    """A step's ``swap_in_ahead`` copies do not lengthen it; the next step's compute starts
    once they are done (exposed only by what the step did not cover); an empty step drains
    them."""
    m = TransferModel()
    t = m.in_seconds(20 * BB)  # ~2.9 ms
    tl = TransferTimeline(m, BB)
    st = tl.step(0.0, SwapPlan(swap_in_ahead=[(c, g) for g, c in pairs(20)]), 0.010)
    assert st.step_s == pytest.approx(0.010) and st.exposed_copy_s == 0.0
    nxt = tl.step(0.010, SwapPlan(), 0.010)  # copies done long before: nothing waits
    assert nxt.step_s == pytest.approx(0.010)
    tl2 = TransferTimeline(m, BB)
    tl2.step(0.0, SwapPlan(swap_in_ahead=[(c, g) for g, c in pairs(20)]), 0.001)
    nxt = tl2.step(0.001, SwapPlan(), 0.010)  # compute waits for the rest of the copies
    assert nxt.step_s == pytest.approx(t - 0.001 + 0.010)
    tl3 = TransferTimeline(m, BB)
    tl3.step(0.0, SwapPlan(swap_in_ahead=[(c, g) for g, c in pairs(20)]), 0.001)
    assert tl3.step(0.001, SwapPlan(), 0.0, num_tokens=0).step_s == pytest.approx(t - 0.001)


def test_swap_ins_ahead_waited_for_by_layers_overlap_the_next_compute() -> None:
    """What-if ``ahead_layered``: the next step's compute starts at once and its layers wait
    for the tail of the copies ahead (layer i for its share), so only what the compute does not
    cover shows; a step that waits for all its swap-ins (a graph step) still waits for them
    first, and an empty step still drains them."""
    m = TransferModel(ahead_layered=True, num_layers=8)
    t = m.in_seconds(20 * BB)  # ~2.9 ms
    ahead = SwapPlan(swap_in_ahead=[(c, g) for g, c in pairs(20)])
    tl = TransferTimeline(m, BB)
    tl.step(0.0, ahead, 0.001)
    rem = t - 0.001
    nxt = tl.step(0.001, SwapPlan(), 0.010)  # 10 ms of compute cover the ~1.9 ms left
    assert nxt.step_s == pytest.approx(max(0.010, rem / 8 + 0.010, rem + 0.010 / 8))
    assert nxt.step_s < rem + 0.010  # what waiting for all first costs
    short = TransferTimeline(m, BB)
    short.step(0.0, ahead, 0.001)
    end = short.step(0.001, SwapPlan(), 0.0008).step_s  # compute shorter than the tail
    assert end == pytest.approx(rem + 0.0008 / 8)
    graph = TransferTimeline(TransferModel(ahead_layered=True, num_layers=8,
                                           graph_max_tokens=512), BB)
    graph.step(0.0, ahead, 0.001)
    assert graph.step(0.001, SwapPlan(), 0.010, num_tokens=100).step_s == \
        pytest.approx(rem + 0.010)
    empty = TransferTimeline(m, BB)
    empty.step(0.0, ahead, 0.001)
    assert empty.step(0.001, SwapPlan(), 0.0, num_tokens=0).step_s == pytest.approx(rem)


def test_host_issue_of_the_copies_delays_the_forward_unless_after_the_launch() -> None:
    """``issue_group_s`` / ``issue_chunk_s``: the host's issue of a step's copies comes before
    its forward (own swap-ins by ``in_groups``, the rest in one group each; ahead copies by
    ``in_groups`` with ``ahead_layered``); with ``background_after_launch`` a graph-sized
    step issues its ahead copies and background swap-outs after the launch instead, which
    then start that much later."""
    g, c = 1.5e-4, 6e-6
    base = dict(issue_group_s=g, issue_chunk_s=c, in_groups=8, num_layers=8)
    out = SwapPlan(swap_out=pairs(10), swap_in_ahead=pairs(20, 100, 100))
    before = TransferTimeline(TransferModel(**base), BB).step(0.0, out, 0.010, 100)
    assert before.step_s == pytest.approx(0.010 + (g + 20 * c) + (g + 10 * c))
    layered = TransferTimeline(TransferModel(**base, ahead_layered=True), BB)
    assert layered.step(0.0, out, 0.010, 100).step_s == pytest.approx(
        0.010 + (8 * g + 20 * c) + (g + 10 * c))
    own = TransferTimeline(TransferModel(**base), BB).step(0.0, SwapPlan(swap_in=pairs(4)),
                                                           0.010, 100)
    assert own.step_s >= 0.010 + 8 * g + 4 * c
    m = TransferModel(**base, background_after_launch=True)
    after = TransferTimeline(m, BB)
    r = after.step(0.0, out, 0.010, 100)
    assert r.step_s == pytest.approx(0.010)  # nothing of its own to issue first
    issued = (g + 20 * c) + (g + 10 * c)
    assert r.background_done_at == pytest.approx(issued + m.out_seconds(10 * BB))
    assert after.ahead_done_at == pytest.approx(issued + m.in_seconds(20 * BB))
    eager = TransferTimeline(m, BB).step(0.0, out, 0.010, 2000)  # not a graph step
    assert eager.step_s == pytest.approx(before.step_s)
    with pytest.raises(ValueError, match="issue_group_s"):
        TransferModel(issue_group_s=-1.0)


def test_urgent_swap_outs_are_exposed_and_go_first() -> None:
    tl = TransferTimeline(TransferModel(), BB)
    bg = tl.step(0.0, SwapPlan(swap_out=pairs(100)), 0.001)
    before = bg.background_done_at
    assert before is not None
    u = 10 * BB / 45e9
    r = tl.step(0.001, SwapPlan(swap_out_first=pairs(10, 500, 500)), 0.002)
    assert r.exposed_copy_s == pytest.approx(u)  # in full, not behind the background batch
    assert tl.next_done_at == pytest.approx(before + u)  # which the urgent copy delayed


def test_urgent_pipelined_what_if_hides_urgent_copies_behind_the_layers() -> None:
    """``urgent_pipelined``: urgent copies join the swap-ins' layer pipeline, exposed only
    beyond the compute (plus the first layer's share); a step that waits for all of its
    swap-ins (a CUDA-graph step) still waits for the urgent copies in full."""
    u, t_in = 40 * BB / 45e9, 20 * BB / 45e9
    plan = SwapPlan(swap_out_first=pairs(40, 500, 500), swap_in=[(c, g) for g, c in pairs(20)])
    compute = 2 * (u + t_in)
    base = TransferTimeline(TransferModel(num_layers=40), BB).step(0.0, plan, compute)
    assert base.exposed_copy_s == pytest.approx(u + t_in / 40)  # urgent in full, layer 0's
    m = TransferModel(num_layers=40, urgent_pipelined=True, graph_max_tokens=512)
    piped = TransferTimeline(m, BB).step(0.0, plan, compute, num_tokens=2048)
    assert piped.exposed_copy_s == pytest.approx((u + t_in) / 40)  # layer 0's share only
    assert piped.urgent_s == pytest.approx(u)
    # a CUDA-graph step (<= 512 tokens) waits for every copy before computing
    graph = TransferTimeline(m, BB).step(0.0, plan, compute, num_tokens=256)
    assert graph.exposed_copy_s == pytest.approx(u + t_in)
    # urgent copies alone, no swap-in: pipelined too
    alone = TransferTimeline(m, BB).step(0.0, SwapPlan(swap_out_first=pairs(40, 500, 500)),
                                         compute, num_tokens=2048)
    assert alone.exposed_copy_s == pytest.approx(u / 40)


def test_swap_in_of_a_chunk_still_being_swapped_out_waits_for_it() -> None:
    tl = TransferTimeline(TransferModel(), BB)
    out = tl.step(0.0, SwapPlan(swap_out=[(5, 7)]), 0.0001)
    done = out.background_done_at
    assert done is not None and out.swap_outs_in_flight == 1
    # CPU block 7 is read back (its chunk's conversation returned) while still being written
    r = tl.step(0.0001, SwapPlan(swap_in=[(7, 9)]), 0.0001)
    t_in = BB / 45e9
    assert t_in > 0.0001  # the copy outlasts the compute it overlaps
    assert 0.0001 + r.step_s == pytest.approx(done + t_in)
    # an unrelated CPU block does not wait
    tl2 = TransferTimeline(TransferModel(), BB)
    tl2.step(0.0, SwapPlan(swap_out=[(5, 7)]), 0.0001)
    r2 = tl2.step(0.0001, SwapPlan(swap_in=[(8, 9)]), 0.0001)
    assert r2.exposed_copy_s == pytest.approx(t_in - 0.0001)  # only beyond the compute


def test_background_batch_after_conflicting_in_stream_work() -> None:
    """A background swap-out into a CPU block a swap-in of the same step reads waits for the
    in stream (plan order: the chunk is read before it is overwritten)."""
    tl = TransferTimeline(TransferModel(), BB)
    t_in = 10 * BB / 45e9
    r = tl.step(0.0, SwapPlan(swap_in=pairs(10, 0, 0), swap_out=[(50, 3)]), 0.1)
    assert r.background_done_at == pytest.approx(t_in + BB / 45e9)
    tl2 = TransferTimeline(TransferModel(), BB)
    r2 = tl2.step(0.0, SwapPlan(swap_in=pairs(10, 0, 0), swap_out=[(50, 30)]), 0.1)
    assert r2.background_done_at == pytest.approx(BB / 45e9)


# ------------------------------------------------------------------------ SimEngine

CHUNK = 8
COST = CostModel.analytic(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                          head_dim=16, intermediate_size=128, chunk_size=CHUNK)
STEP = StepCostModel(base_s=4e-3, per_prefill_step_s=2e-3, per_request_s=1e-5,
                     per_prefill_token_s=4e-5, per_decode_token_s=1e-5,
                     per_kv_read_token_s=1e-8, per_swap_chunk_s=1e-3, swap_copy_chunk_s=5e-4)


def make_sim(transfer: TransferModel | None, clock: VirtualClock, block_bytes: int = BB,
             **kw: object) -> SimEngine:
    sim = SimEngine(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8,
                                    max_model_len=512),
                    24, 12, STEP, clock, COST, chunk_size=CHUNK, cache_policy="pensieve",
                    block_bytes=block_bytes, vocab_size=256, transfer=transfer,
                    **kw)  # type: ignore[arg-type]
    sim.audit = True
    return sim


def _one_request(rid: str, ntok: int, out: int = 0) -> ScheduledRequest:
    return ScheduledRequest(rid, [0], [QueryRange(0, [1] * ntok)], sample=True,
                            sampling_params=SamplingParams(max_tokens=4),
                            num_output_tokens=out)


def test_execute_reports_in_flight_and_exposed_time() -> None:
    clock = VirtualClock()
    sim = make_sim(TransferModel(swap_out_gbps=1.0), clock)
    sched = SchedulerOutput([_one_request("a", 5)], SwapPlan(swap_out=pairs(3)))
    out = sim.executor.execute(sched)
    compute = STEP.compute_time(features_of(sched))
    assert out.step_time_s == pytest.approx(compute) and clock.now() == pytest.approx(compute)
    assert out.swap_outs_in_flight == 1
    rec = sim.executor.step_records[-1]
    assert rec.exposed_copy_s == pytest.approx(0.0)
    assert rec.background_done_at == pytest.approx(3 * BB / 1e9)
    assert rec.swap_out_chunks == 3 and rec.urgent_swap_out_chunks == 0
    # later steps see it in flight until 3 * BB / 1 GB/s = 19.7 ms have passed
    seen = []
    while clock.now() < 0.03:
        k = sim.executor.execute(SchedulerOutput([_one_request("a", 1, 1)])).swap_outs_in_flight
        seen.append((clock.now(), k))  # the step's end
    assert all(k == (1 if t < 3 * BB / 1e9 else 0) for t, k in seen)
    assert seen[0][1] == 1
    assert seen[-1][1] == 0
    # urgent copies: exposed in full, as are swap-ins beyond the compute
    urgent = sim.executor.execute(SchedulerOutput([_one_request("a", 1, 1)],
                                          SwapPlan(swap_out_first=pairs(2, 10, 10))))
    f = features_of(SchedulerOutput([_one_request("a", 1, 1)]))
    assert urgent.step_time_s == pytest.approx(STEP.compute_time(f) + 2 * BB / 1e9)
    assert sim.executor.step_records[-1].exposed_copy_s == pytest.approx(2 * BB / 1e9)


def test_legacy_copies_without_a_transfer_model() -> None:
    clock = VirtualClock()
    sim = make_sim(None, clock)
    sched = SchedulerOutput([_one_request("a", 5)], SwapPlan(swap_in=pairs(2),
                                                             swap_out=pairs(30, 10, 10)))
    out = sim.executor.execute(sched)
    f = features_of(sched)
    assert out.step_time_s == pytest.approx(STEP.predict(f))
    assert out.swap_outs_in_flight == 0 and sim.executor.step_log[-1][0].exposed_copy_s is None
    assert sim.executor.step_records[-1].exposed_copy_s == pytest.approx(STEP.predict(f)
                                                                - STEP.compute_time(f))


def drive(sim: SimEngine, clock: VirtualClock, seed: int, check: bool,
          num_convs: int = 6, turns: int = 4) -> None:
    """Staggered multi-turn conversations; with ``check``, after every step the GPU blocks of
    the background batches still in flight are neither free nor held by any chunk."""
    rng = random.Random(seed)
    plan = {f"c{c}": [(rng.randrange(8, 30), rng.randrange(4, 12)) for _ in range(turns)]
            for c in range(num_convs)}
    arrivals = sorted((0.01 * i, cid, 0) for i, cid in enumerate(plan))
    pending = list(arrivals)
    live = 0
    while pending or live:
        pending.sort()
        while pending and pending[0][0] <= clock.now():
            _, cid, k = pending.pop(0)
            n_in, n_out = plan[cid][k]
            sim.add_request(f"{cid}-t{k}", [rng.randrange(1, 256) for _ in range(n_in)],
                            SamplingParams(max_tokens=n_out, ignore_eos=True),
                            conversation_id=cid)
            live += 1
        if not live:
            clock.sleep_until(pending[0][0])
            continue
        for out in sim.step():
            live -= 1
            cid, k = out.conversation_id, int(out.request_id.rsplit("t", 1)[1])
            if k + 1 < turns:
                pending.append((clock.now() + rng.expovariate(1 / 0.05), cid, k + 1))
        if check:
            _check_in_flight_blocks(sim)


def _check_in_flight_blocks(sim: SimEngine) -> None:
    assert sim.executor.transfers is not None
    cache = sim.cache
    held = {ch.block for conv in cache.conversations.values() for ch in conv.chunks
            if ch.tier is Tier.GPU}
    for b in sim.executor.transfers.in_flight:
        for g in b.gpu_reads:
            assert not cache.gpu.is_free(g), f"GPU block {g} free while its copy runs"
            assert g not in held, f"GPU block {g} reused while its copy runs"


def test_sim_runs_with_slow_background_copies_and_records_steps() -> None:
    clock = VirtualClock()
    sim = make_sim(TransferModel(swap_in_gbps=20.0, swap_out_gbps=0.5, latency_s=1e-4,
                                 num_layers=40), clock)
    drive(sim, clock, seed=1, check=False)
    recs = sim.executor.step_records
    assert len(recs) == sim.num_steps == len(sim.executor.step_log)
    assert any(r.swap_outs_in_flight > 0 for r in recs)
    assert any(r.swap_outs_in_flight > 1 for r in recs)  # batches outlive several steps
    assert [r.step_time_s for r in recs] == [dt for _, dt in sim.executor.step_log]
    assert sum(r.exposed_copy_s for r in recs) == pytest.approx(sim.executor.exposed_copy_s)
    assert sim.executor.exposed_copy_s > 0
    for (f, dt), r in zip(sim.executor.step_log, recs, strict=True):
        assert f.exposed_copy_s == pytest.approx(r.exposed_copy_s)
        assert dt == pytest.approx(r.compute_s + r.exposed_copy_s)
    stats = sim.cache.stats
    assert sum(r.cached_tokens for r in recs) == stats.gpu_hit_tokens + stats.cpu_hit_tokens
    assert sum(r.recomputed_tokens for r in recs) == stats.recomputed_tokens
    assert sum(r.cpu_recomputed_tokens for r in recs) == getattr(stats, "cpu_recomputed_tokens",
                                                                 0)
    assert sum(r.new_prompt_tokens for r in recs) == stats.new_prompt_tokens
    assert sum(r.swap_in_chunks for r in recs) == sim.executor.swap_in_chunks
    assert sum(r.swap_out_chunks + r.urgent_swap_out_chunks for r in recs) == \
        sim.executor.swap_out_chunks
    assert sum(r.prefill_tokens + r.decode_tokens for r in recs) == \
        sum(f.num_tokens for f, _ in sim.executor.step_log)
    assert json.dumps([r.as_dict() for r in recs[:3]])
    # the exposed copy time makes the step log refit exactly (compute coefficients recovered)
    m = StepCostModel.fit(sim.executor.step_log, swap_copy_chunk_s=STEP.swap_copy_chunk_s)
    assert relative_errors(m, sim.executor.step_log)["max"] < 1e-6
    assert m.per_swap_chunk_s == 0.0  # copies are the transfer model's, not a coefficient


def test_cache_reclaims_gpu_blocks_only_when_the_simulated_copy_is_done() -> None:
    for seed in range(3):
        for bw in ("auto", "off"):  # swap-or-recompute by cost, or always swap in
            clock = VirtualClock()
            sim = make_sim(TransferModel(swap_in_gbps=20.0, swap_out_gbps=0.5), clock,
                           swap_bandwidth_gbps=bw)
            drive(sim, clock, seed=seed, check=True)
            assert any(r.swap_outs_in_flight > 1 for r in sim.executor.step_records)
            assert any(r.swap_in_chunks for r in sim.executor.step_records)


def test_step_record_counts_match_the_engine_record() -> None:
    from pensieve.core.outputs import RunnerOutput
    from pensieve.engine import step_record

    p = SamplingParams(max_tokens=4)
    sched = SchedulerOutput([
        ScheduledRequest("a", [0], [QueryRange(0, [1] * 7)], True, p, 0),
        ScheduledRequest("b", [1], [QueryRange(9, [1])], True, p, 3),
        ScheduledRequest("c", [2], [QueryRange(0, [1])], True, p, 0),  # a 1-token prompt
        ScheduledRequest("d", [3], [QueryRange(0, [1] * 3), QueryRange(40, [1] * 2)], True,
                         p, 0),
    ], SwapPlan(swap_out_first=pairs(1), swap_in=pairs(2, 5, 5), swap_out=pairs(3, 9, 9)))
    rec = step_record.StepRecord.of(sched, RunnerOutput({}), 0.0, 0.0, 0.0)
    assert (rec.prefill_tokens, rec.decode_tokens) == prefill_decode_tokens(sched) == (13, 1)
    clock = VirtualClock()
    sim = make_sim(TransferModel(), clock)
    sim.executor.execute(sched)
    mine = sim.executor.step_records[-1]
    for name in ("num_requests", "prefill_tokens", "decode_tokens", "swap_in_chunks",
                 "swap_out_chunks", "urgent_swap_out_chunks"):
        assert getattr(mine, name) == getattr(rec, name), name


def test_sim_hands_swap_chunk_seconds_to_the_cache() -> None:
    clock = VirtualClock()
    sim30 = make_sim(TransferModel(swap_in_gbps=30.0), clock)
    assert sim30.swap_chunk_s == pytest.approx(BB / 30e9)
    assert sim30.cache.swap_chunk_s == sim30.swap_chunk_s
    assert make_sim(TransferModel(), clock, swap_bandwidth_gbps="off").swap_chunk_s is None
    legacy = make_sim(None, clock)
    assert legacy.swap_chunk_s is None and legacy.cache.swap_chunk_s is None
    assert make_sim(TransferModel(), clock, swap_bandwidth_gbps=9.0).swap_chunk_s == \
        pytest.approx(BB / 9e9)
    assert make_sim(TransferModel(), clock, block_bytes=0).swap_chunk_s is None
    with pytest.raises(ValueError):
        make_sim(TransferModel(), clock, swap_bandwidth_gbps="fast")
    with pytest.raises(ValueError):
        make_sim(TransferModel(), clock, block_bytes=0, swap_bandwidth_gbps=9.0)

    from pensieve.config import CacheConfig, EngineConfig

    cfg = EngineConfig(cache=CacheConfig(chunk_size=CHUNK, num_gpu_blocks=24, num_cpu_blocks=8,
                                         swap_bandwidth_gbps=15.0))
    sim = SimEngine.from_config(cfg, STEP, clock, COST, block_bytes=BB)
    assert sim.swap_chunk_s == pytest.approx(BB / 15e9)
    assert sim.cache.swap_chunk_s == sim.swap_chunk_s
    off = EngineConfig(cache=CacheConfig(chunk_size=CHUNK, num_gpu_blocks=24, num_cpu_blocks=8,
                                         swap_bandwidth_gbps="off"))
    assert SimEngine.from_config(off, STEP, clock, COST, block_bytes=BB).swap_chunk_s is None


# ------------------------------------------------------------------------ compatibility


@pytest.mark.parametrize("path", sorted((ROOT / "docs" / "results").glob("*/step_cost*.json")))
def test_existing_step_cost_files_load_and_predict_as_before(path: Path) -> None:
    m = StepCostModel.load(path)
    f = StepFeatures(num_prefill_tokens=100, num_decode_tokens=20, num_requests=21,
                     attn_pairs=1e5, kv_read_tokens=30_000, swap_in_chunks=10,
                     swap_out_chunks=6, urgent_swap_out_chunks=2)
    c = m.compute_time(f)
    assert m.predict(f) == pytest.approx(c + m.exposed_copy_time(f, c)
                                         + m.per_swap_chunk_s * f.swap_chunks)
    import dataclasses

    known = dataclasses.replace(f, exposed_copy_s=0.0123)
    assert m.predict(known) == pytest.approx(c + 0.0123)
    assert StepCostModel.from_dict(m.to_dict()) == m


def test_old_step_records_still_fit(tmp_path: Path) -> None:
    """Step records of the first real H200 run (400 rows of the multiturn benchmark's
    steps.jsonl.gz, written before ``exposed_copy_s`` existed) still load and fit."""
    src = ROOT / "tests" / "data" / "steps_first_engine_400.jsonl.gz"
    with gzip.open(src, "rt") as fh:
        lines = [next(fh) for _ in range(400)]
    recs = []
    for line in lines:
        d = json.loads(line)
        assert "exposed_copy_s" not in d
        d.pop("system")
        t = d.pop("time_s")
        recs.append((StepFeatures.from_dict(d), t))
    assert all(f.exposed_copy_s is None for f, _ in recs)
    m = StepCostModel.fit(recs, swap_copy_chunk_s=BB / 55e9)
    assert m.fit_num_records == 400
    # new records (exposed_copy_s written, maybe null) read back too
    f = recs[0][0]
    assert StepFeatures.from_dict(json.loads(json.dumps(f.to_dict()))) == f


def test_copy_waits_match_the_runner() -> None:
    """The simulated ordering is the runner's (``pensieve.runner.swapper.step_waits``) on
    random plans against random batches in flight."""
    from pensieve.runner import swapper
    from pensieve.sim.step_cost import copy_waits

    rng = random.Random(0)

    def some(n: int, lo: int = 0, hi: int = 12) -> list[tuple[int, int]]:
        return [(rng.randrange(lo, hi), rng.randrange(lo, hi)) for _ in range(n)]

    for _ in range(500):
        plan = SwapPlan(swap_out_first=some(rng.randrange(3)), swap_in=some(rng.randrange(4)),
                        swap_out=some(rng.randrange(4)))
        batches = [swapper.InFlight(frozenset(rng.sample(range(12), rng.randrange(4))),
                                    frozenset(rng.sample(range(12), rng.randrange(4))))
                   for _ in range(rng.randrange(4))]
        want = swapper.step_waits(plan, batches)
        assert copy_waits(plan, batches) == (want.in_after, want.out_after_in)


def test_graph_steps_wait_for_all_swap_ins_and_empty_steps_drain() -> None:
    m = TransferModel(graph_max_tokens=512)
    assert m.waits_for_all_swap_ins(512) and not m.waits_for_all_swap_ins(513)
    assert not m.waits_for_all_swap_ins(None) and not m.waits_for_all_swap_ins(0)
    assert TransferModel(pipelined=False).waits_for_all_swap_ins(10_000)
    with pytest.raises(ValueError):
        TransferModel(graph_max_tokens=-1)
    t_in = 64 * BB / 45e9
    small = TransferTimeline(m, BB).step(0.0, SwapPlan(swap_in=pairs(64)), 0.020, 100)
    big = TransferTimeline(m, BB).step(0.0, SwapPlan(swap_in=pairs(64)), 0.020, 1000)
    assert small.exposed_copy_s == pytest.approx(t_in)  # a graph step: copy, then compute
    assert big.exposed_copy_s == pytest.approx(0.0)  # eager: hidden behind the compute
    # a step with no request waits for every batch in flight and reports none
    tl = TransferTimeline(TransferModel(), BB)
    first = tl.step(0.0, SwapPlan(swap_out=pairs(100)), 0.001, 10)
    assert first.swap_outs_in_flight == 1 and first.background_done_at is not None
    drain = tl.step(0.002, SwapPlan(), 0.0005, 0)
    assert drain.swap_outs_in_flight == 0 and not tl.in_flight
    assert 0.002 + drain.step_s == pytest.approx(first.background_done_at)


def test_graph_steps_with_many_swap_ins_of_their_own_run_pipelined() -> None:
    """The runner's rule (``ModelRunner.graph_max_swap_in``): a step the graphs would replay
    runs eagerly, pipelined, when it has more swap-in chunks of its own than the limit; the
    ones ahead do not count."""
    m = TransferModel(num_layers=40, graph_max_tokens=512, graph_max_swap_in=21)
    assert m.waits_for_all_swap_ins(100, 21) and not m.waits_for_all_swap_ins(100, 22)
    assert not m.waits_for_all_swap_ins(1000, 0)  # eager by size, as before
    assert TransferModel(pipelined=False, graph_max_swap_in=1).waits_for_all_swap_ins(10, 99)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="graph_max_swap_in"):
            TransferModel(graph_max_swap_in=bad)  # type: ignore[arg-type]
    assert TransferModel.from_dict(m.to_dict()) == m
    rule_off = TransferModel(num_layers=40, graph_max_tokens=512)
    compute = 0.020
    for n, waits in ((21, True), (64, False)):
        plan = SwapPlan(swap_in=pairs(n))
        got = TransferTimeline(m, BB).step(0.0, plan, compute, 100)
        all_in = TransferTimeline(rule_off, BB).step(0.0, plan, compute, 100)
        t_in = n * BB / 45e9
        assert all_in.exposed_copy_s == pytest.approx(t_in)
        if waits:
            assert got.exposed_copy_s == pytest.approx(t_in)
        else:  # layer 0's share exposed, the rest behind the compute
            assert got.exposed_copy_s == pytest.approx(t_in / 40)
    ahead = SwapPlan(swap_in=pairs(4), swap_in_ahead=pairs(60, 100))
    assert TransferTimeline(m, BB).step(0.0, ahead, compute, 100).exposed_copy_s == \
        pytest.approx(4 * BB / 45e9)  # 4 of its own: a graph step waiting for them


def test_simulated_graph_swap_in_limit_is_the_runners() -> None:

    from pensieve.runner.model_runner import graph_max_swap_in

    jobs = importlib.import_module("sim_churn_jobs")
    assert jobs.GRAPH_MAX_SWAP_IN == graph_max_swap_in(jobs.KV_BYTES_PER_TOKEN * jobs.CHUNK)
    assert jobs.transfer_model(graph_rule=True).graph_max_swap_in == jobs.GRAPH_MAX_SWAP_IN
    assert jobs.transfer_model().graph_max_swap_in is None


def test_steps_the_rule_makes_eager_pay_the_eager_launch_time() -> None:
    m = TransferModel(num_layers=40, graph_max_tokens=512, graph_max_swap_in=2,
                      eager_launch_s=0.005)
    assert m.eager_extra_s(100, 3) == 0.005
    assert m.eager_extra_s(100, 2) == 0.0 and m.eager_extra_s(600, 3) == 0.0  # graph / eager
    assert m.eager_extra_s(None, 3) == 0.0
    assert TransferModel(graph_max_tokens=512, eager_launch_s=0.005).eager_extra_s(100, 99) \
        == 0.0  # no rule, no eager steps
    with pytest.raises(ValueError, match="eager_launch_s"):
        TransferModel(eager_launch_s=-1.0)
    steps = {}
    for eager in (0.0, 0.005):
        clock = VirtualClock()
        sim = make_sim(dataclasses.replace(m, eager_launch_s=eager), clock)
        sched = SchedulerOutput([_one_request("a", 5)], SwapPlan(swap_in=pairs(3, 10, 0)))
        steps[eager] = (sim.executor.execute(sched).step_time_s, sim.executor.exposed_copy_s,
                        sim.executor.step_records[-1])
    (t0, e0, r0), (t1, e1, r1) = steps[0.0], steps[0.005]
    assert t1 == pytest.approx(t0 + 0.005, abs=1e-9)  # compute ran longer, the copies hid
    assert e1 <= e0 and r1.compute_s == pytest.approx(r0.compute_s + 0.005)
