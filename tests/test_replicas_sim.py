"""N simulated replicas behind a router (benchmarks/replicas_sim.py): every turn's context is the
whole conversation whatever replica serves it, time never runs back, affinity keeps a
conversation where its KV is."""

from __future__ import annotations

import heapq
import random

import pytest
from replicas_sim import ReplicatedSim, replica_names

from pensieve.bench.engine_api import VirtualClock
from pensieve.core.cost_model import CostModel
from pensieve.core.routing import AffinityRouter, RandomRouter
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.scheduling_config import SchedulerConfig
from pensieve.sim.simulator import SimEngine
from pensieve.sim.step_cost import StepCostModel

CHUNK = 8
COST = CostModel.analytic(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                          head_dim=16, intermediate_size=128, chunk_size=CHUNK)
STEP = StepCostModel.analytic(num_params=13e9, num_layers=40, num_heads=40, num_kv_heads=10,
                              head_dim=128, chunk_size=CHUNK)


def make(clock: VirtualClock) -> SimEngine:
    sim = SimEngine(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8,
                                    max_model_len=1024),
                    48, 24, STEP, clock, COST, chunk_size=CHUNK, cache_policy="pensieve",
                    block_bytes=1000, vocab_size=256)
    sim.audit = True
    return sim


def drive(eng: ReplicatedSim, clock: VirtualClock, num_convs: int = 12, turns: int = 4,
          seed: int = 0) -> dict[str, list]:
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
            eng.add_request(rid, ids, SamplingParams(max_tokens=n_out, ignore_eos=True),
                            arrival_time=clock.now(), conversation_id=cid)
        if not expect:
            clock.sleep_until(heap[0][0])
            continue
        done = eng.step()
        assert clock.now() >= last  # the step that ran started no earlier than the last
        last = clock.now()
        for r in eng.replicas:
            r.cache.check_integrity()
        for out in done:
            cid, k = out.conversation_id, int(out.request_id.rsplit("t", 1)[1])
            assert out.prompt_token_ids == expect.pop(out.request_id)
            assert out.arrival_time <= out.first_token_time <= out.finish_time
            history[cid] = out.prompt_token_ids + out.output_token_ids
            outs[cid].append(out)
            if k + 1 < turns:
                heapq.heappush(heap, (out.finish_time + rng.expovariate(1 / 0.3), cid, k + 1))
    assert not eng.has_unfinished()
    return outs


@pytest.mark.parametrize("routing", ["affinity", "random"])
def test_contexts_are_whole_conversations(routing: str) -> None:
    clock = VirtualClock()
    router = (AffinityRouter(replica_names(3)) if routing == "affinity"
              else RandomRouter(replica_names(3), seed=3))
    eng = ReplicatedSim(3, make, clock, router)
    outs = drive(eng, clock)
    assert all(len(v) == 4 for v in outs.values())
    st = eng.routing_stats()
    assert st["requests"] == 48 and all(n > 0 for n in st["served_per_replica"])
    later = [o.cache_stats for v in outs.values() for o in v[1:]]
    hits = sum(s["gpu_hit_tokens"] + s["cpu_hit_tokens"] for s in later)
    # a later turn that lands away from its KV computes its whole history there (the replica
    # sees it as the first turn of a conversation); at home it computes its own input and the
    # last answer token (sampled, never fed back)
    own_input = [len(o.prompt_token_ids) - len(prev.prompt_token_ids + prev.output_token_ids)
                 for v in outs.values() for prev, o in zip(v, v[1:])]
    away = sum(s["new_prompt_tokens"] > n + 1 for s, n in zip(later, own_input))
    if routing == "affinity":
        assert st["moved_turns"] == 0  # no replica got hot enough to spill
        assert hits > 0 and away == 0
    else:
        assert st["moved_turns"] > 0 and away > 0


def test_affinity_reuses_more_than_random() -> None:
    hit = {}
    for routing in ("affinity", "random"):
        clock = VirtualClock()
        router = (AffinityRouter(replica_names(4)) if routing == "affinity"
                  else RandomRouter(replica_names(4), seed=1))
        eng = ReplicatedSim(4, make, clock, router)
        outs = drive(eng, clock, num_convs=16, seed=5)
        hit[routing] = sum(o.cache_stats["gpu_hit_tokens"] + o.cache_stats["cpu_hit_tokens"]
                           for v in outs.values() for o in v)
    assert hit["affinity"] > hit["random"]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        ReplicatedSim(0, make, VirtualClock())
    with pytest.raises(ValueError):
        ReplicatedSim(2, make, VirtualClock(), AffinityRouter(replica_names(3)))


