"""Affinity routing with bounded load (core/routing.py)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pensieve.core.routing import (
    AffinityRouter,
    RandomRouter,
    conversation_key,
    least_loaded,
    preference,
    spill_route,
)

NAMES = [f"replica-{i}" for i in range(8)]


def test_key_is_the_id_or_the_first_messages() -> None:
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    later = first + [{"role": "assistant", "content": "hello"},
                     {"role": "user", "content": "more"}]
    assert conversation_key(first) == conversation_key(later)  # re-sent history: same key
    bare = [{"role": "user", "content": "hi"}]  # no system prompt: turn 1 and turn 2 agree
    assert conversation_key(bare) == conversation_key(
        bare + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "x"}])
    assert conversation_key(bare) != conversation_key(first)
    other = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "bye"}]
    assert conversation_key(first) != conversation_key(other)
    assert conversation_key(first, "c1") == "id:c1" != conversation_key(first, "c2")
    assert conversation_key(["a", "b", "c"]) == conversation_key(["a", "x"])  # first string
    assert conversation_key([{"role": "user", "content": "\ud800"}]).startswith("msg:")


def test_unloaded_routing_is_sticky_and_spreads_evenly() -> None:
    r = AffinityRouter(NAMES)
    idle = [0] * len(NAMES)
    keys = [f"id:{i}" for i in range(4000)]
    first = [r.route(k, idle) for k in keys]
    assert first == [r.route(k, idle) for k in keys]  # every turn goes back
    counts = Counter(first)
    assert set(counts) == set(range(len(NAMES)))
    assert max(counts.values()) < 1.2 * len(keys) / len(NAMES)


def test_a_replica_leaving_moves_only_its_keys() -> None:
    keys = [f"id:{i}" for i in range(2000)]
    full = {k: NAMES[preference(k, NAMES)[0]] for k in keys}
    fewer = [n for n in NAMES if n != "replica-3"]
    after = {k: fewer[preference(k, fewer)[0]] for k in keys}
    moved = [k for k in keys if full[k] != after[k]]
    assert moved and all(full[k] == "replica-3" for k in moved)


def test_hot_replica_spills_to_the_next_choice() -> None:
    r = AffinityRouter(NAMES[:4], load_factor=1.25, min_load=4)
    key = "id:hot"
    home, second = preference(key, r.replicas)[:2]
    loads = [2, 2, 2, 2]
    assert r.route(key, loads) == home
    loads[home] = 50  # far above 1.25 x the mean
    assert r.route(key, loads) == second
    loads = [0, 0, 0, 0]
    loads[home] = 3  # hotter than the rest, but under min_load: stays
    assert r.route(key, loads) == home


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 100), min_size=1, max_size=8), st.text(max_size=20),
       st.floats(1.0, 3.0), st.integers(1, 32))
def test_routed_replica_is_under_the_bound(loads: list[int], key: str, factor: float,
                                           min_load: int) -> None:
    r = AffinityRouter(NAMES[: len(loads)], load_factor=factor, min_load=min_load)
    i = r.route(key, loads)
    assert 0 <= i < len(loads)
    assert loads[i] < r.capacity(loads)
    # the first replica in the key's order that is under the bound
    order = preference(key, r.replicas)
    assert i == next(j for j in order if loads[j] < r.capacity(loads))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        AffinityRouter([])
    with pytest.raises(ValueError):
        AffinityRouter(["a", "a"])
    with pytest.raises(ValueError):
        AffinityRouter(["a"], load_factor=0.5)
    with pytest.raises(ValueError):
        AffinityRouter(["a"], min_load=0)
    with pytest.raises(ValueError):
        AffinityRouter(["a", "b"]).route("k", [0])
    rnd = RandomRouter(NAMES[:3], seed=1)
    assert set(rnd.route("same", [0, 0, 0]) for _ in range(200)) == {0, 1, 2}


def test_least_loaded_and_spill() -> None:
    waiting = [500.0, 100.0, 300.0]
    assert least_loaded(waiting) == 1
    assert least_loaded(waiting, alive=[True, False, True]) == 2
    assert spill_route(0, waiting, bound=600) == 0  # under the bound: stays
    assert spill_route(0, waiting, bound=400) == 1  # over: the least loaded
    assert spill_route(1, waiting, bound=50) == 1  # over, but no one waits on less
    assert spill_route(0, waiting, bound=600, alive=[False, True, True]) == 1  # owner gone
    with pytest.raises(ValueError):
        spill_route(0, waiting, bound=-1)
    with pytest.raises(ValueError):
        least_loaded(waiting, alive=[False, False, False])
