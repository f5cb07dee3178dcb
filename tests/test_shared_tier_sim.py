"""Replicas with a shared KV tier in the simulator (benchmarks/shared_tier_sim.py): every turn's
context is its whole conversation under each routing, a moved turn reads its history from the
tier instead of recomputing it and waits for the transfer, a lost replica's turns finish
elsewhere; and the step cost leaves read positions uncomputed (sim/step_cost.features_of)."""

from __future__ import annotations

import heapq
import random

import pytest
from shared_tier_sim import RoutedCluster

from pensieve.bench.engine_api import VirtualClock
from pensieve.core.cost_model import CostModel
from pensieve.core.outputs import QueryRange, ScheduledRequest, SchedulerOutput
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.scheduling_config import SchedulerConfig
from pensieve.sim.simulator import SimEngine
from pensieve.sim.step_cost import StepCostModel, features_of

CHUNK = 8
COST = CostModel.analytic(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                          head_dim=16, intermediate_size=128, chunk_size=CHUNK)
STEP = StepCostModel.analytic(num_params=13e9, num_layers=40, num_heads=40, num_kv_heads=10,
                              head_dim=128, chunk_size=CHUNK)
KV = 100_000  # bytes a token


def make(clock: VirtualClock) -> SimEngine:
    sim = SimEngine(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8,
                                    max_model_len=1024),
                    48, 24, STEP, clock, COST, chunk_size=CHUNK, cache_policy="pensieve",
                    block_bytes=1000, vocab_size=256)
    sim.audit = True
    return sim


def drive(eng: RoutedCluster, clock: VirtualClock, num_convs: int = 12, turns: int = 4,
          seed: int = 0, sent: dict[str, float] | None = None) -> dict[str, list]:
    """Conversations of ``turns`` turns; checks each turn's context is the whole history.
    ``sent``: filled with each request's send time."""
    rng = random.Random(seed)
    plan = {f"c{c}": [(rng.randrange(3, 14), rng.randrange(2, 9)) for _ in range(turns)]
            for c in range(num_convs)}
    heap = [(0.02 * i, cid, 0) for i, cid in enumerate(plan)]
    heapq.heapify(heap)
    history: dict[str, list[int]] = {cid: [] for cid in plan}
    outs: dict[str, list] = {cid: [] for cid in plan}
    expect: dict[str, list[int]] = {}
    last = clock.now()
    while heap or expect:
        while heap and heap[0][0] <= clock.now():
            _, cid, k = heapq.heappop(heap)
            n_in, n_out = plan[cid][k]
            ids = [rng.randrange(1, 256) for _ in range(n_in)]
            rid = f"{cid}-t{k}"
            expect[rid] = history[cid] + ids
            if sent is not None:
                sent[rid] = clock.now()
            eng.add_request(rid, ids, SamplingParams(max_tokens=n_out, ignore_eos=True),
                            arrival_time=clock.now(), conversation_id=cid)
        if not expect:
            clock.sleep_until(heap[0][0])
            continue
        done = eng.step()
        assert clock.now() >= last
        last = clock.now()
        for out in done:
            cid, k = out.conversation_id, int(out.request_id.rsplit("t", 1)[1])
            assert out.prompt_token_ids[-len(expect[out.request_id]):] == expect.pop(
                out.request_id)
            assert out.arrival_time <= out.first_token_time <= out.finish_time
            history[cid] = out.prompt_token_ids + out.output_token_ids
            outs[cid].append(out)
            if k + 1 < turns:
                heapq.heappush(heap, (out.finish_time + rng.expovariate(1 / 0.3), cid, k + 1))
    assert not eng.has_unfinished()
    return outs


@pytest.mark.parametrize("routing", ["affinity", "spill", "least"])
def test_every_turn_finishes_with_its_whole_conversation(routing: str) -> None:
    clock = VirtualClock()
    eng = RoutedCluster(3, make, clock, routing, KV, gbps=None if routing == "affinity" else 25,
                        bound=20)
    outs = drive(eng, clock)
    assert all(len(v) == 4 for v in outs.values())
    st = eng.routing_stats()
    if routing == "least":
        assert st["moved_turns"] > 0
    if routing != "affinity":  # every moved history read from the tier, none recomputed
        assert st["recomputed_history_tokens"] == 0
        assert (st["loaded_tokens"] > 0) == (st["moved_turns"] > 0)
        net = eng.network(0.0, clock.now() + 1, bin_s=1.0)
        assert net["write_gb"] > 0 and 0 <= net["read_util_peak"] <= 1.0
    else:
        assert st["loaded_tokens"] == 0


def test_a_moved_turn_waits_for_its_read() -> None:
    """The same run over a slow and a fast link: a turn reaches its replica only once its
    history's read is done (its TTFT counts from the send), and on the slow link the reads
    alone take longer than the whole fast run's TTFTs."""
    ttft, read = {}, {}
    for gbps in (0.01, 100.0):
        clock = VirtualClock()
        eng = RoutedCluster(3, make, clock, "least", KV, gbps=gbps)
        sent: dict[str, float] = {}
        outs = drive(eng, clock, seed=2, sent=sent)
        ttft[gbps] = sum(o.first_token_time - sent[o.request_id] for v in outs.values()
                         for o in v)
        read[gbps] = eng.routing_stats()["loaded_tokens"] * KV * 8 / (gbps * 1e9)
        assert read[gbps] > 0
        assert all(o.arrival_time >= sent[o.request_id] for v in outs.values() for o in v)
    assert ttft[0.01] >= read[0.01] > ttft[100.0]


def test_a_lost_replica_serves_nothing_after_and_every_turn_finishes() -> None:
    clock = VirtualClock()
    eng = RoutedCluster(3, make, clock, "spill", KV, gbps=25, bound=20, fail_at=0.5,
                        fail_replica=1)
    outs = drive(eng, clock, num_convs=16)
    assert all(len(v) == 4 for v in outs.values())
    assert not eng.alive[1]
    late = [o for v in outs.values() for o in v if o.first_token_time > 0.5]
    assert late and not eng.replicas[1].has_unfinished()


def test_read_positions_are_not_computed() -> None:
    """A range of 10 prefill tokens at 0..10 with 0..6 read from the tier computes 4 tokens
    (6..10) and their attention pairs only."""
    req = ScheduledRequest("r", (), [QueryRange(0, list(range(10)))], True, SamplingParams(), 0)
    sched = SchedulerOutput([req])
    full = features_of(sched)
    part = features_of(sched, {"r": (0, 6)})
    assert full.num_prefill_tokens == 10 and part.num_prefill_tokens == 4
    assert part.attn_pairs == sum(p + 1 for p in range(6, 10))
    assert full.attn_pairs == sum(p + 1 for p in range(10))
    assert features_of(sched, {"other": (0, 6)}) == full
    assert features_of(sched, {"r": (0, 10)}).num_prefill_tokens == 0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        RoutedCluster(2, make, VirtualClock(), "random", KV)
    with pytest.raises(ValueError):
        RoutedCluster(2, make, VirtualClock(), "least", KV)  # no network rate
