"""Routing with a shared KV tier, without a Ray cluster: the engine's waiting prompt tokens
(what each replica reports), the spill ranking over them (``core/routing.spill_ranking``) and
the replicas' router choosing with replicas' routing stats (``replicas/router.py``)."""

from __future__ import annotations

import argparse
import asyncio
import time
from types import SimpleNamespace

import pytest

from pensieve.bench.engine_api import VirtualClock
from pensieve.core.cost_model import CostModel
from pensieve.core.routing import DEFAULT_SPILL_TOKENS, preference, spill_ranking
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.scheduling_config import SchedulerConfig
from pensieve.replicas.options import add_replica_args, spill_tokens_arg
from pensieve.sim.simulator import SimEngine
from pensieve.sim.step_cost import StepCostModel

IDS = ["r-a", "r-b", "r-c"]


def _key_owned_by(i: int, ids: list[str] = IDS) -> str:
    """A routing key whose rendezvous first choice is ``ids[i]``."""
    return next(k for k in (f"id:c{n}" for n in range(1000)) if preference(k, ids)[0] == i)


def test_spill_ranking_keeps_the_owner_under_the_bound() -> None:
    key = _key_owned_by(0)
    order = preference(key, IDS)
    assert spill_ranking(key, IDS, [0, 0, 0], 100) == order
    assert spill_ranking(key, IDS, [100, 0, 0], 100) == order  # at the bound: stays
    # a known owner (the key's last replica) comes first, then the key's rendezvous order
    assert spill_ranking(key, IDS, [0, 0, 0], 100, owner=2) == [2] + [i for i in order if i != 2]


def test_spill_ranking_moves_past_the_bound_to_the_fewest_waiting() -> None:
    key = _key_owned_by(0)
    order = preference(key, IDS)
    ranked = spill_ranking(key, IDS, [101, 50, 7], 100)
    assert ranked == [2] + [i for i in order if i != 2]
    assert spill_ranking(key, IDS, [101, 7, 50], 100)[0] == 1
    # over the bound, but every other replica waits on as many: stays
    assert spill_ranking(key, IDS, [101, 101, 200], 100)[0] == 0
    # the owner given by the last turn is the one measured against the bound
    assert spill_ranking(key, IDS, [500, 300, 0], 400, owner=1)[0] == 1
    assert spill_ranking(key, IDS, [0, 500, 300], 400, owner=1)[0] == 0
    with pytest.raises(ValueError):
        spill_ranking(key, IDS, [0, 0], 100)


def test_spill_tokens_option() -> None:
    p = argparse.ArgumentParser()
    add_replica_args(p)
    assert p.parse_args([]).route_spill_tokens == DEFAULT_SPILL_TOKENS == 16384
    assert p.parse_args(["--route-spill-tokens", "512"]).route_spill_tokens == 512
    assert p.parse_args(["--route-spill-tokens", "off"]).route_spill_tokens is None
    for bad in ("-1", "many"):
        with pytest.raises(argparse.ArgumentTypeError):
            spill_tokens_arg(bad)


# ------------------------------------------------------------------ the engine's waiting tokens

CHUNK = 8


def _sim() -> SimEngine:
    cost = CostModel.analytic(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                              head_dim=16, intermediate_size=128, chunk_size=CHUNK)
    step = StepCostModel.analytic(num_params=1e9, num_layers=16, num_heads=16, num_kv_heads=4,
                                  head_dim=64, chunk_size=CHUNK)
    return SimEngine(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8,
                                     max_model_len=512),
                     64, 16, step, VirtualClock(), cost, chunk_size=CHUNK, block_bytes=1000,
                     vocab_size=256)


def _drain(sim: SimEngine) -> list[int]:
    seen = []
    while sim.has_unfinished():
        sim.step()
        seen.append(sim.num_waiting_tokens)
    return seen


def test_engine_waiting_tokens_count_what_is_left_to_compute() -> None:
    sim = _sim()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert sim.num_waiting_tokens == 0
    sim.add_request("a1", list(range(1, 41)), params, conversation_id="a")
    sim.add_request("b1", list(range(1, 31)), params, conversation_id="b")
    assert sim.num_waiting_tokens == 70 == sim.cache_stats()["waiting_tokens"]
    seen = _drain(sim)
    assert seen[0] < 70 and seen[-1] == 0
    # the next turn of "a": its history's KV is here, only its new tokens wait
    sim.add_request("a2", [7, 8, 9, 10, 11], params, conversation_id="a")
    assert 5 <= sim.num_waiting_tokens <= 6  # (the last answer token's KV: not yet computed)
    _drain(sim)
    assert sim.num_waiting_tokens == 0


# ------------------------------------------------------------------ the router over routing stats


def _router(spill_tokens: int | None):
    router_mod = pytest.importorskip("pensieve.replicas.router",
                                     reason="the replicas extra is not installed")
    r = object.__new__(router_mod.AffinityRequestRouter)  # no Ray Serve machinery behind it
    r.initialize_state(load_factor=1.25, min_load=1, spill_tokens=spill_tokens)
    return r, router_mod


def _replica(uid: str, waiting: int | None) -> SimpleNamespace:
    stats = {} if waiting is None else {"waiting_tokens": waiting}
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=uid), routing_stats=stats)


def _choose(router, replicas, key: str) -> str:
    pending = SimpleNamespace(kwargs={"routing_key": key}, created_at=time.time(),
                              routing_context=SimpleNamespace(should_backoff=False))
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    assert len(ranks) == 1 and len(ranks[0]) == 1  # PATIENCE_S: the first rank alone
    return ranks[0][0].replica_id.unique_id


def test_router_spills_on_reported_waiting_tokens_and_the_turn_stays_moved() -> None:
    router, mod = _router(spill_tokens=1000)
    key = _key_owned_by(0, IDS[:2])
    calm = [_replica("r-a", 10), _replica("r-b", 0)]
    assert _choose(router, calm, key) == "r-a"
    assert mod.waiting_tokens(None) == 0 == mod.waiting_tokens({"waiting_tokens": "x"})
    assert _choose(router, [_replica("r-a", None), _replica("r-b", None)], key) == "r-a"
    busy = [_replica("r-a", 1001), _replica("r-b", 200)]
    assert _choose(router, busy, key) == "r-b"  # past the bound: the fewest waiting
    # the key's turns now belong to r-b: they stay there once r-a is calm again
    assert _choose(router, calm, key) == "r-b"
    assert _choose(router, [_replica("r-a", 0), _replica("r-b", 1000)], key) == "r-b"
    assert _choose(router, [_replica("r-a", 0), _replica("r-b", 1001)], key) == "r-a"
    # its replica gone: the key's rendezvous choice among the rest
    assert _choose(router, [_replica("r-c", 5)], key) == "r-c"


def test_router_without_a_shared_tier_ignores_waiting_tokens() -> None:
    router, _ = _router(spill_tokens=None)
    # Ray Serve's queue lengths: none known (0 requests in flight)
    router._replica_queue_len_cache = SimpleNamespace(get=lambda replica_id: None)
    key = _key_owned_by(0, IDS[:2])
    busy = [_replica("r-a", 10**6), _replica("r-b", 0)]
    assert _choose(router, busy, key) == "r-a"


def test_waiting_tokens_are_counted_when_asked_not_after_every_step() -> None:
    """The count is a pass over the engine's turns: the server's snapshot after each step
    carries the counters without it, and the replicas' routing stats ask for it (an engine
    call, between two steps)."""
    from pensieve.server import engine_ops
    from pensieve.server.engine_loop import EngineLoop

    sim = _sim()
    sim.add_request("a1", list(range(1, 41)), SamplingParams(max_tokens=4), conversation_id="a")
    snap = EngineLoop(sim, lambda *_: None).snapshot()
    assert snap.stats is not None and "waiting_tokens" not in snap.stats
    assert snap.stats["gpu_blocks_total"] == sim.cache_stats()["gpu_blocks_total"]
    assert engine_ops.waiting_tokens(sim) == 40 == sim.cache_stats()["waiting_tokens"]
