"""The simulator's clairvoyant ``oracle`` eviction order: recompute saved per second until the
conversation's next turn, ended conversations first; and the load generator that tells it."""

from __future__ import annotations

from test_simulator import COST, STEP
from test_tiered_cache import C, cost, tiers, turn

from pensieve.bench.engine_api import VirtualClock
from pensieve.bench.loadgen import run_load
from pensieve.bench.workload import Conversation as WorkloadConversation
from pensieve.bench.workload import Turn
from pensieve.core.cache_config import CacheConfig
from pensieve.core.conversation import Conversation
from pensieve.core.eviction import POLICIES, OraclePolicy, get_policy
from pensieve.core.scheduling_config import SchedulerConfig
from pensieve.core.tiered_cache import TieredKVCache
from pensieve.sim.simulator import SimEngine


def test_key_grows_as_the_next_turn_nears_and_along_the_conversation() -> None:
    p = OraclePolicy(next_think_s={"a": 100.0})  # back at 100 s
    c = Conversation("a", kv_end=64_000, last_active=0.0)
    keys = [p.key(c, 100, t, cost, 32)[0] for t in (0.0, 50.0, 90.0, 99.0, 99.9)]
    assert all(a < b for a, b in zip(keys, keys[1:]))  # not a lower bound: key_may_grow
    assert p.key_may_grow and not POLICIES["pensieve"].key_may_grow
    # value = Cost(context of the chunk) / seconds until the next turn
    assert p.key(c, 100, 90.0, cost, 32)[0] == cost(101 * 32) / 10.0
    along = [p.key(c, i, 5.0, cost, 32)[0] for i in (0, 10, 500, 1999)]
    assert all(a < b for a, b in zip(along, along[1:]))  # leading chunks first


def test_ended_and_unknown_conversations_go_before_every_live_one() -> None:
    p = OraclePolicy(next_think_s={"live": 1e6, "ended": None})
    live = Conversation("live", kv_end=100, last_active=50.0)  # 1e6 s away: a tiny value
    ended = Conversation("ended", kv_end=100_000, last_active=59.0)
    unknown = Conversation("unknown", kv_end=100_000, last_active=58.0)
    k_live = p.key(live, 0, 60.0, cost, 32)
    assert p.key(ended, 3000, 60.0, cost, 32) < k_live
    assert p.key(unknown, 3000, 60.0, cost, 32) < p.key(ended, 0, 60.0, cost, 32)  # LRU


def test_queued_conversations_keep_the_queue_floor() -> None:
    c = Conversation("q", kv_end=4_000, last_active=0.0)
    c.queued_at = 5.0
    assert OraclePolicy(next_think_s={"q": 5.0}).key(c, 3, 100.0, cost, 32) == \
        get_policy("pensieve").key(c, 3, 100.0, cost, 32)


def test_cache_evicts_the_ended_session_before_the_soon_returning_one() -> None:
    """Two idle conversations, the ended one longer and used last: pensieve's ``Cost / idle``
    and prefix-lru evict from the older one, which returns in 2 s; the oracle evicts the ended
    one's leading chunks and keeps the returning one whole."""
    nxt: dict[str, float | None] = {"soon": 12.0, "ended": None}  # "soon" is back at 12 s
    got = {}
    for name, policy in (("oracle", OraclePolicy(next_think_s=nxt)),
                         ("pensieve", get_policy("pensieve")),
                         ("prefix-lru", get_policy("prefix-lru"))):
        cache = TieredKVCache(7, 0, cost, CacheConfig(chunk_size=C, swap_out_threshold=0.0,
                                                      decode_reserve=0.0, share_prefixes=False,
                                                      defer_admission=0),
                              policy=policy, key_refresh_s=5.0)
        turn(cache, "soon", 11, now=0.0)  # 12 tokens: 3 chunks
        turn(cache, "ended", 15, now=9.0)  # 4 chunks: the GPU tier is full
        turn(cache, "new", 7, now=10.0)  # 2 chunks: 2 evicted
        got[name] = (tiers(cache, "soon"), tiers(cache, "ended"))
    assert got["oracle"] == (["gpu"] * 3, ["dropped", "dropped", "gpu", "gpu"])
    assert got["pensieve"] == (["dropped", "dropped", "gpu"], ["gpu"] * 4)
    assert got["prefix-lru"] == (["gpu", "dropped", "dropped"], ["gpu"] * 4)


def test_loadgen_tells_each_think_time_and_the_oracle_runs_in_the_simulator() -> None:
    """``run_load`` writes, as each turn is accepted, the think time after it (the next turn
    is sent at the answer's finish plus that), and None with a conversation's last turn; the
    simulator with the oracle over that map serves the load with its tiers under eviction and
    its cache audited after every step (an idle conversation's key never changes under the
    index: the map is written only while its turn is queued or running)."""

    class Recorder(dict[str, float | None]):
        def __init__(self) -> None:
            super().__init__()
            self.writes: list[tuple[str, float | None]] = []

        def __setitem__(self, key: str, value: float | None) -> None:
            self.writes.append((key, value))
            super().__setitem__(key, value)

    nxt = Recorder()
    clock = VirtualClock()
    sim = SimEngine(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8,
                                    max_model_len=512), 24, 6, STEP, clock, COST,
                    chunk_size=8, cache_policy=OraclePolicy(next_think_s=nxt),
                    block_bytes=1000, vocab_size=256)
    sim.audit = True
    assert sim.cache.policy.name == "oracle" and sim.cache.index.key_refresh_s == 0.0
    convs = [WorkloadConversation("long", [Turn(60, 20)] * 4),
             WorkloadConversation("short", [Turn(10, 5)] * 3)]
    res = run_load(sim, clock, convs, conv_rate=2.0, think_time_s=0.5, duration_s=4.0,
                   vocab_size=256, seed=2, drain_s=1000.0, next_think_s=nxt)
    assert res.unfinished == 0 and len(res.records) > 10
    recs = {(f"{convs[int(r.conversation[1:]) % 2].conv_id}#{r.conversation[1:]}", r.turn): r
            for r in res.records}
    told: dict[str, int] = {}
    for cid, think in nxt.writes:
        k = told[cid] = told.get(cid, -1) + 1  # the k-th write is turn k's
        if think is None:
            assert (cid, k) in recs and (cid, k + 1) not in recs
        else:
            nxt_sent, finished = recs[(cid, k + 1)].sent, recs[(cid, k)].finished
            assert finished is not None and abs(nxt_sent - (finished + think)) < 1e-6
    assert len(nxt.writes) == len(recs) and all(v is None for v in nxt.values())
    assert sim.cache_stats()["swapped_out_tokens"] > 0  # the tiny tiers did evict


def test_belady_variant_is_blind_to_cost() -> None:
    """Plain Belady keeps the conversation needed first whatever its length; the cost-weighted
    oracle keeps the long one, needed a little later, whose recompute saved per second is
    higher."""
    think = {"short": 5.0, "long": 8.0}
    short = Conversation("short", kv_end=1_000, last_active=0.0)
    long = Conversation("long", kv_end=100_000, last_active=0.0)
    tail_s, tail_l = 1_000 // 32 - 1, 100_000 // 32 - 1
    belady = OraclePolicy(weigh_cost=False, next_think_s=think)
    weighted = OraclePolicy(next_think_s=think)
    assert belady.key(long, tail_l, 1.0, cost, 32) < belady.key(short, tail_s, 1.0, cost, 32)
    assert weighted.key(short, tail_s, 1.0, cost, 32) < weighted.key(long, tail_l, 1.0, cost, 32)
