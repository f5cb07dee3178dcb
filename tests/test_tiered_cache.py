"""The two-tier cache and its policies on hand-built cases, with exact blocks and order."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pensieve.core.cache_config import CacheConfig
from pensieve.core.conversation import Conversation, Tier
from pensieve.core.eviction import EvictionPolicy, OraclePolicy, get_policy
from pensieve.core.eviction_index import EvictionIndex
from pensieve.core.kv_store import KVStore
from pensieve.core.outputs import RunnerOutput
from pensieve.core.request import Request
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.scheduler import Scheduler
from pensieve.core.scheduling_config import SchedulerConfig
from pensieve.core.tiered_cache import TieredKVCache
from pensieve.engine.engine_core import EngineCore
from pensieve.engine.executor import TierSizes

C = 4
CACHE_OPTIONS = {f.name for f in dataclasses.fields(CacheConfig)}


def unshared(chunk_size: int, **kw: Any) -> CacheConfig:
    """A cache config as these tests ran before the cache took one: no prefix sharing, no
    admission deferral unless asked."""
    return CacheConfig(chunk_size=chunk_size, **{"share_prefixes": False,
                                                  "defer_admission": 0, **kw})


def cost(context_len: int) -> float:
    return 1.0 + 0.01 * context_len  # grows with context: leading chunks are cheaper


def make(policy: str, gpu: int = 8, cpu: int = 4, threshold: float = 0.5,
         **kw: Any) -> TieredKVCache:
    opts = {k: kw.pop(k) for k in list(kw) if k in CACHE_OPTIONS}
    return TieredKVCache(gpu, cpu, cost, unshared(C, swap_out_threshold=threshold,
                                                  decode_reserve=0.0, **opts),
                         policy=get_policy(policy), **kw)


def new_turn(cache: TieredKVCache, cid: str, new: int, now: float
             ) -> tuple[Request, Conversation]:
    """A turn of ``new`` input tokens for ``cid``, its pending positions set, not admitted."""
    conv = cache.conversation(cid)
    req = Request(f"{cid}@{now}", conv.token_ids + [1] * new, SamplingParams(max_tokens=1),
                  conversation_id=cid)
    req.pending = cache.pending_for(req, conv)
    return req, conv


def turn(cache: TieredKVCache, cid: str, new: int, now: float, out_token: int = 9) -> Request:
    """Admit a turn of ``new`` input tokens, compute everything, sample one token, end it."""
    req, conv = new_turn(cache, cid, new, now)
    assert cache.admit(req, conv, req.num_tokens, now)
    req.take(req.num_pending)
    req.append_output(out_token)
    cache.end_turn(req, conv, now)
    cache.check_integrity()
    return req


def tiers(cache: TieredKVCache, cid: str) -> list[str]:
    return [ch.tier.value for ch in cache.conversations[cid].chunks]


def test_pensieve_evicts_older_conversation_and_leading_chunks_first() -> None:
    cache = make("pensieve")
    cache.begin_step()
    turn(cache, "A", 12, now=0.0)  # 12 prompt tokens + 1 output: KV for 12 -> 3 chunks
    turn(cache, "B", 12, now=10.0)
    assert cache.block_table(cache.conversations["A"]) == (0, 1, 2)
    assert cache.block_table(cache.conversations["B"]) == (3, 4, 5)
    cache.take_swap_plan()
    # 2 free of 8, threshold 4: two chunks go, the leading ones of the idler conversation
    cache.plan_background(now=20.0)
    plan = cache.take_swap_plan()
    assert plan.swap_out == [(0, 0), (1, 1)] and not plan.swap_out_first
    assert tiers(cache, "A") == ["cpu", "cpu", "gpu"]
    assert tiers(cache, "B") == ["gpu", "gpu", "gpu"]
    assert cache.gpu.num_free_blocks == 2  # reclaimed once the runner reports the copy done
    cache.check_integrity()
    cache.begin_step()
    assert cache.gpu.num_free_blocks == 2
    cache.reclaim_swap_outs(0)
    assert cache.gpu.num_free_blocks == 4
    assert cache.stats.swapped_out_tokens == 8


def test_cpu_tier_full_drops_lowest_value_chunk() -> None:
    cache = make("pensieve", gpu=8, cpu=2, threshold=0.75)
    cache.begin_step()
    turn(cache, "A", 12, now=0.0)
    turn(cache, "B", 12, now=10.0)
    cache.take_swap_plan()
    # threshold 6 blocks, 2 free: 4 chunks must leave the GPU; the CPU tier holds 2
    cache.plan_background(now=20.0)
    plan = cache.take_swap_plan()
    # A0, A1 to the CPU; then A2 displaces A0 (lower value) which is dropped; then B0
    # (value 1.04/10) is higher than A1's (1.08/20): A1 is dropped to make room for it.
    assert tiers(cache, "A") == ["dropped", "dropped", "cpu"]
    assert tiers(cache, "B") == ["cpu", "gpu", "gpu"]
    # the copies of A0 and A1 were cancelled when they were dropped within the same step
    assert [g for g, _ in plan.swap_out] == [2, 3]
    assert cache.stats.dropped_tokens == 8 and cache.stats.swapped_out_tokens == 8
    cache.check_integrity()


def test_next_turn_recomputes_dropped_swaps_in_cpu_and_hits_gpu() -> None:
    cache = make("pensieve", gpu=8, cpu=2, threshold=0.75)
    cache.begin_step()
    turn(cache, "A", 12, now=0.0)
    turn(cache, "B", 12, now=10.0)
    cache.plan_background(now=20.0)
    cache.take_swap_plan()
    cache.begin_step()
    conv = cache.conversations["A"]  # [dropped][dropped][cpu], kv_end 12, 13 tokens of history
    req = Request("A2", conv.token_ids + [2, 3], SamplingParams(), conversation_id="A")
    req.pending = cache.pending_for(req, conv)
    # recompute positions 0..7, then from kv_end (12) on: the last output and the new input
    assert req.pending == [(0, 8), (12, 15)]
    cpu_block = conv.chunks[2].block
    assert cache.admit(req, conv, 15, now=30.0)
    plan = cache.take_swap_plan()
    assert plan.swap_in == [(cpu_block, conv.chunks[2].block)]
    assert tiers(cache, "A") == ["gpu"] * 4
    st = req.cache_stats
    assert (st.gpu_hit_tokens, st.cpu_hit_tokens, st.recomputed_tokens, st.new_prompt_tokens) == (
        0, 4, 8, 3)
    ranges = req.take(req.num_pending)
    assert [(r.start_pos, r.query_len) for r in ranges] == [(0, 8), (12, 3)]
    cache.check_integrity()


def test_lru_evicts_whole_least_recent_conversation() -> None:
    cache = make("lru")
    cache.begin_step()
    turn(cache, "A", 12, now=0.0)
    turn(cache, "B", 12, now=10.0)
    cache.plan_background(now=20.0)  # needs 2 chunks, takes all 3 of A
    assert [g for g, _ in cache.take_swap_plan().swap_out] == [0, 1, 2]
    assert tiers(cache, "A") == ["cpu"] * 3 and tiers(cache, "B") == ["gpu"] * 3


def test_prefix_lru_evicts_tail_first() -> None:
    cache = make("prefix-lru")
    cache.begin_step()
    turn(cache, "A", 12, now=0.0)
    turn(cache, "B", 12, now=10.0)
    cache.plan_background(now=20.0)
    assert [g for g, _ in cache.take_swap_plan().swap_out] == [2, 1]
    assert tiers(cache, "A") == ["gpu", "cpu", "cpu"]


def test_gpu_only_drops_and_stateless_keeps_nothing() -> None:
    cache = make("gpu-only", gpu=6, cpu=4)
    cache.begin_step()
    assert cache.cpu is None
    turn(cache, "A", 12, now=0.0)
    turn(cache, "B", 12, now=10.0)
    cache.plan_background(now=20.0)  # no CPU tier: nothing ahead of time
    assert cache.take_swap_plan().is_empty
    # a third conversation needs 3 blocks, none free: A's leading chunks are dropped
    turn(cache, "C", 10, now=30.0)
    assert tiers(cache, "A") == ["dropped", "dropped", "dropped"]
    assert cache.stats.dropped_tokens == 12

    st = make("stateless")
    st.begin_step()
    req = turn(st, "A", 12, now=0.0)
    assert st.conversations["A"].chunks == [] and st.gpu.num_free_blocks == 8
    assert st.conversations["A"].token_ids == req.all_token_ids
    req2 = turn(st, "A", 2, now=1.0)
    assert req2.cache_stats.recomputed_tokens == 12 and req2.cache_stats.new_prompt_tokens == 3


def test_suspend_and_abort_keep_the_conversation_consistent() -> None:
    cache = make("pensieve", gpu=8, cpu=8)
    cache.begin_step()
    turn(cache, "A", 6, now=0.0)  # history 7 tokens, kv_end 6
    conv = cache.conversations["A"]
    before = list(conv.token_ids)
    req = Request("A2", conv.token_ids + [5] * 9, SamplingParams(), conversation_id="A")
    req.pending = cache.pending_for(req, conv)
    assert cache.admit(req, conv, 10, now=1.0)
    req.take(4)  # positions 6..9 computed; 10..15 still pending
    cache.take_swap_plan()
    cache.suspend(req, conv, now=2.0)
    assert conv.kv_end == 10 and tiers(cache, "A") == ["cpu", "cpu", "cpu"]
    assert len(cache.take_swap_plan().swap_out_first) == 3
    cache.check_integrity()
    cache.abort_turn(req, conv, now=3.0)  # the turn is dropped: back to the old history
    assert conv.token_ids == before and conv.kv_end == 7 and len(conv.chunks) == 2
    cache.check_integrity()


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="cache_policy") as err:
        get_policy("fifo")
    for name in ("pensieve", "gpu-only", "lru", "prefix-lru", "stateless"):
        assert repr(name) in str(err.value)  # the message lists what would have worked
        assert get_policy(name).name == name


# --------------------------------------------------------------------------- the eviction index
IDS = [f"c{k}" for k in range(6)]


def brute_victim(index: EvictionIndex, tier: Tier) -> tuple[object, str, int] | None:
    """The reference: the idle chunk of lowest key in ``tier``, over every chunk, at ``now``."""
    best = None
    for conv in index.conversations.values():
        if conv.running:
            continue
        for i, ch in enumerate(conv.chunks):
            if ch.tier is tier:
                k = index.policy.key(conv, i, index.now, index.chunk_cost, index.chunk_size)
                if best is None or k < best[0]:
                    best = (k, conv.conversation_id, i)
    return best


def reference_pass(store: KVStore, n: int, now: float) -> tuple[dict[str, list[Tier]], int]:
    """What an eviction pass of ``n`` GPU chunks must do, by brute force over every chunk: the
    lowest GPU chunk leaves (with ``whole_conversation``, the rest of its conversation too); it
    goes to a free CPU block, or displaces the lowest CPU chunk if that one's key is not
    higher, or else is dropped. Returns every conversation's tiers after it, and the count."""
    convs, policy = store.index.conversations, store.index.policy
    tiers = {cid: [ch.tier for ch in conv.chunks] for cid, conv in convs.items()}
    free = store.cpu.num_free_blocks if store.cpu is not None else 0

    def lowest(tier: Tier) -> tuple[object, str, int] | None:
        return min(((policy.key(convs[cid], i, now, store.index.chunk_cost, C), cid, i)
                    for cid, ts in tiers.items() if not convs[cid].running
                    for i, t in enumerate(ts) if t is tier), default=None)

    done, last = 0, None
    while (top := lowest(Tier.GPU)) is not None:
        k, cid, i = top
        if done >= n and not (policy.whole_conversation and cid == last):
            break
        if store.cpu is None:
            tiers[cid][i] = Tier.DROPPED
        elif free:
            tiers[cid][i], free = Tier.CPU, free - 1
        else:
            v = lowest(Tier.CPU)
            if v is None or k < v[0]:  # type: ignore[operator]
                tiers[cid][i] = Tier.DROPPED
            else:
                tiers[v[1]][v[2]], tiers[cid][i] = Tier.DROPPED, Tier.CPU
        done, last = done + 1, cid
    return tiers, done


class CheckedIndex(EvictionIndex):
    """Checks every eviction choice against :func:`brute_victim`."""

    choices = 0

    def peek_victim(self, tier: Tier):  # noqa: ANN201
        got = super().peek_victim(tier)
        want = brute_victim(self, tier)
        mine = None if got is None else (got[0], got[1].conversation_id, got[2])
        assert mine == want, (tier, mine, want)
        self.choices += 1
        return got


class CheckedStore(KVStore):
    """Checks every eviction pass against :func:`reference_pass`."""

    passes = 0

    def evict_gpu(self, n: int, now: float, urgent: bool) -> int:
        want = reference_pass(self, n, now)
        done = super().evict_gpu(n, now, urgent)
        got = {cid: [ch.tier for ch in conv.chunks]
               for cid, conv in self.index.conversations.items()}
        assert (got, done) == want
        self.passes += 1
        return done


class CheckedCache(TieredKVCache):
    """A cache whose index and store check every eviction choice and pass (above)."""

    index_class = CheckedIndex
    store_class = CheckedStore

    @property
    def choices(self) -> int:
        assert isinstance(self.index, CheckedIndex)
        return self.index.choices

    @property
    def passes(self) -> int:
        assert isinstance(self.store, CheckedStore)
        return self.store.passes


class Driver:
    """Random operations on a cache, as the scheduler would issue them."""

    def __init__(self, cache: TieredKVCache) -> None:
        self.cache = cache
        self.now = 0.0
        self.running: dict[str, Request] = {}
        self.suspended: dict[str, Request] = {}
        self.turns = 0

    def do(self, kind: str, a: int, b: int, dt: float) -> None:
        cache = self.cache
        self.now += dt
        idle = [c for c in IDS if c not in self.running]
        run = sorted(self.running)
        if kind == "admit" and idle:
            cid = idle[a % len(idle)]
            conv = cache.conversation(cid)
            req = self.suspended.pop(cid, None)
            if req is None:
                if len(conv.token_ids) > 40:
                    cache.delete(cid)
                    conv = cache.conversation(cid)
                req = Request(f"{cid}#{self.turns}", conv.token_ids + [1 + b % 7] * (1 + b % 13),
                              SamplingParams(max_tokens=99), conversation_id=cid)
                self.turns += 1
            pending = cache.pending_for(req, conv)
            total = sum(hi - lo for lo, hi in pending)
            n = 1 + (a * 7 + b) % total
            req.pending = pending
            spare = None if b % 4 == 0 else (b % 3) * 6
            swap_ins = cache.num_planned_swap_ins
            if cache.admit(req, conv, req.pending_end(n), self.now, spare_tokens=spare,
                           may_defer=b % 3 == 0):
                if a % 2:  # as the scheduler does for a turn that computes next step
                    cache.swap_in_ahead(swap_ins)
                n += req.num_pending - total
                assert spare is None or req.num_pending - total <= spare
                req.take(n)
                self.running[cid] = req
            else:
                req.pending = []
                if req.output_token_ids or req.num_tokens > len(conv.token_ids) + 13:
                    self.suspended[cid] = req  # keep a suspended turn waiting
        elif kind in ("grow", "end") and run:
            cid = run[a % len(run)]
            req, conv = self.running[cid], cache.conversations[cid]
            if not req.pending:
                req.append_output(9)
            n = req.num_pending if kind == "end" else min(req.num_pending, 1 + b % 9)
            if cache.grow(conv, req.pending_end(n), self.now):
                req.take(n)
                if kind == "end" and not req.pending:
                    req.append_output(9)
                    cache.end_turn(req, conv, self.now)
                    del self.running[cid]
            else:
                cache.suspend(req, conv, self.now)
                self.suspended[cid] = self.running.pop(cid)
        elif kind == "suspend" and run:
            cid = run[a % len(run)]
            cache.suspend(self.running[cid], cache.conversations[cid], self.now)
            self.suspended[cid] = self.running.pop(cid)
        elif kind == "abort" and (run or self.suspended):
            pool = run + sorted(self.suspended)
            cid = pool[a % len(pool)]
            req = self.running.pop(cid, None) or self.suspended.pop(cid)
            cache.abort_turn(req, cache.conversations[cid], self.now)
        elif kind == "delete":
            free = [c for c in idle if c not in self.suspended]
            if free:
                cache.delete(free[a % len(free)])
        elif kind == "hint" and idle:
            cache.set_hints(cache.conversation(idle[a % len(idle)]), priority=0.5 + b % 4,
                            keep_alive_s=(a % 3) * 0.7)
        elif kind == "step":
            cache.plan_background(self.now)
            cache.take_swap_plan()
            cache.reclaim_swap_outs(a % (len(cache.store._reclaim_groups) + 1))
            cache.begin_step()
        cache.check_integrity()


KINDS = ["admit", "admit", "grow", "grow", "end", "end", "suspend", "abort", "delete", "hint",
         "step", "step"]


@st.composite
def operations(draw: st.DrawFn) -> list[tuple[str, int, int, float]]:
    """A random operation sequence, from a drawn seed (long sequences that reach full tiers)."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    return [(rng.choice(KINDS), rng.randint(0, 50), rng.randint(0, 50),
             rng.choice([0.0, 0.0, 0.05, 0.4, 3.0])) for _ in range(draw(st.integers(1, 120)))]


ORACLE_THINK = {cid: None if k % 3 == 0 else 4.0 * k for k, cid in enumerate(IDS)}
"""The ``oracle``'s think times in the property test: some conversations end, the others come
back a few operations after their turn ends (their keys grow meanwhile)."""


def policy_named(name: str) -> EvictionPolicy:
    return OraclePolicy(next_think_s=ORACLE_THINK) if name == "oracle" else get_policy(name)


@settings(max_examples=1000, deadline=None, derandomize=True)
@given(policy=st.sampled_from(["pensieve", "lru", "prefix-lru", "gpu-only", "return", "oracle"]),
       ops=operations(),
       gpu=st.integers(6, 20), cpu=st.integers(0, 8),
       swap_chunk_s=st.sampled_from([None, 0.0, 0.4, 1.5, 100.0]),
       threshold=st.sampled_from([0.0, 0.25, 0.5]), reserve=st.sampled_from([0.0, 0.1]),
       refresh=st.sampled_from([0.0, 0.5, 5.0]), defer=st.sampled_from([0, 0, 1, 3]))
def test_index_evicts_as_brute_force_and_stays_consistent(
        policy: str, ops: list[tuple[str, int, int, float]], gpu: int, cpu: int,
        swap_chunk_s: float | None, threshold: float, reserve: float, refresh: float,
        defer: int) -> None:
    """Random admit / grow / end / suspend / abort / delete / hints / steps (with background
    swap-outs left in flight): every victim the index picks is the brute-force lowest key (at
    ``now``) over every idle chunk, and every eviction pass does what :func:`reference_pass`
    does, whatever the re-key interval; the index and the counts match a full recomputation
    after every operation. Admissions may wait for background swap-outs (``defer``). The
    ``oracle``'s keys grow while idle: its index is exact only because it re-keys at every
    eviction time whatever ``refresh`` says."""
    cache = CheckedCache(gpu, cpu, cost, unshared(C, swap_out_threshold=threshold,
                                                  decode_reserve=reserve, defer_admission=defer),
                         policy=policy_named(policy), key_refresh_s=refresh,
                         swap_chunk_s=swap_chunk_s)
    d = Driver(cache)
    for op in ops:
        d.do(*op)


def test_many_evictions_at_one_now_keep_the_exact_list_bounded() -> None:
    """Evictions that all happen at the same now (a clock that does not move) turn the
    entries they keyed at now back into bounds once the list grows: still exact, bounded."""
    cache = CheckedCache(40, 0, cost, unshared(C, swap_out_threshold=0.0, decode_reserve=0.0),
                         policy=get_policy("gpu-only"), key_refresh_s=5.0)
    cache.index.exact_max = 0
    d = Driver(cache)
    rng = random.Random(5)
    for _ in range(400):
        d.do(rng.choice(["admit", "end", "end", "grow"]), rng.randrange(50), rng.randrange(50),
             0.0)
        assert len(cache.index.keyed_now) <= 2 * len(cache.index.gpu.live) + 2 * 40
    assert cache.choices > 50


def test_brute_force_check_sees_evictions() -> None:
    """The property test's checker runs (a fixed sequence that evicts in both tiers)."""
    cache = CheckedCache(8, 2, cost, unshared(C, swap_out_threshold=0.75, decode_reserve=0.0),
                         policy=get_policy("pensieve"), key_refresh_s=0.0)
    turn(cache, "A", 12, now=0.0)
    turn(cache, "B", 12, now=10.0)
    cache.plan_background(now=20.0)
    # GPU and CPU victims (a run of one conversation's chunks is one GPU choice), the pass
    assert cache.choices >= 4 and cache.passes == 1
    assert tiers(cache, "A") == ["dropped", "dropped", "cpu"]


def test_refresh_interval_rekeys_as_time_passes() -> None:
    """Keys are evaluated at t_e in [now, now + key_refresh_s] (lower bounds of the keys at
    now); once now leaves that interval, the index is re-keyed at the new time."""
    cache = make("pensieve", gpu=12, cpu=8, key_refresh_s=5.0)
    index = cache.index
    # A: long idle, long context (costly); B: recent, short context (cheap)
    turn(cache, "A", 28, now=0.0)   # 7 chunks, Cost ~1.3 per chunk at the tail
    turn(cache, "B", 4, now=9.0)    # 1 chunk
    index.refresh(9.5)  # evaluated at 14.5: A idle 14.5, B idle 5.5
    assert index.t_eval == 14.5
    key_a = index.gpu.live[cache.conversations["A"]][2]
    assert key_a == cache.policy.key(cache.conversations["A"], 0, 14.5, cost, C)
    index.refresh(12.0)  # still inside [9.5, 14.5]: no re-key
    assert index.t_eval == 14.5
    # the victim is exact at now = 12 although the heap holds keys at 14.5
    _, conv, i = index.peek_victim(Tier.GPU)
    assert (conv.conversation_id, i) == brute_victim(index, Tier.GPU)[1:]
    cache.check_integrity()
    index.refresh(20.0)
    assert index.t_eval == 25.0
    cache.check_integrity()


def test_exact_order_where_a_snapshot_would_be_wrong() -> None:
    """Two conversations whose order flips between now and t_e: at now = 10, B (idle since 9,
    priority 0.2) is worth more than A (idle since 0); at 14.5 it is worth less. The index,
    keyed at 14.5, still evicts A first at 10."""
    cache = make("pensieve", gpu=20, cpu=20, key_refresh_s=4.5)
    turn(cache, "A", 4, now=0.0)  # 1 chunk, Cost 1.04
    turn(cache, "B", 4, now=9.0)
    a, b = cache.conversations["A"], cache.conversations["B"]
    cache.set_hints(b, priority=0.2)
    key = cache.policy.key
    assert key(a, 0, 10.0, cost, C) < key(b, 0, 10.0, cost, C)
    assert key(b, 0, 14.5, cost, C) < key(a, 0, 14.5, cost, C)
    cache.index.refresh(10.0)
    assert cache.index.t_eval == 14.5
    assert cache.index.gpu.peek()[1] is b  # the lower bounds alone would pick B
    _, conv, _ = cache.index.peek_victim(Tier.GPU)
    assert conv is a
    cache.check_integrity()


def test_hints_rekey_idle_conversations() -> None:
    cache = make("pensieve", gpu=8, cpu=4, key_refresh_s=0.0)
    turn(cache, "A", 12, now=0.0)
    turn(cache, "B", 12, now=10.0)
    cache.set_hints(cache.conversations["A"], priority=100.0)  # A is now worth keeping
    cache.plan_background(now=20.0)
    assert tiers(cache, "A") == ["gpu"] * 3 and tiers(cache, "B") == ["cpu", "cpu", "gpu"]
    cache.check_integrity()


# --------------------------------------------------------------------------- reclaim groups
def test_background_swap_outs_reclaimed_when_reported_done() -> None:
    """Each step's background swap-outs are one group; groups are freed oldest first as the
    runner reports fewer batches in flight (2, then 1, then 0)."""
    cache = make("pensieve", gpu=8, cpu=8, threshold=0.5)
    turn(cache, "A", 12, now=0.0)   # blocks 0-2
    turn(cache, "B", 12, now=10.0)  # blocks 3-5; 2 free, threshold 4
    cache.plan_background(now=20.0)
    g1 = [g for g, _ in cache.take_swap_plan().swap_out]
    assert g1 == [0, 1]
    cache.reclaim_swap_outs(1)  # still copying
    cache.begin_step()
    assert cache.gpu.num_free_blocks == 2 and cache.has_pending_swap_outs
    turn(cache, "C", 8, now=21.0)   # takes both free blocks (6, 7)
    cache.plan_background(now=22.0)  # 0 free + 2 pending: 2 more go
    g2 = [g for g, _ in cache.take_swap_plan().swap_out]
    assert len(g2) == 2 and not set(g1) & set(g2)
    cache.check_integrity()
    cache.reclaim_swap_outs(2)  # both groups in flight
    assert cache.gpu.num_free_blocks == 0
    cache.begin_step()
    assert cache.gpu.num_free_blocks == 0  # a new step frees nothing by itself
    cache.reclaim_swap_outs(1)  # the older group is done
    assert sorted(cache.gpu._free) == sorted(g1)
    cache.check_integrity()
    cache.reclaim_swap_outs(0)
    assert sorted(cache.gpu._free) == sorted(g1 + g2) and not cache.has_pending_swap_outs
    cache.check_integrity()
    with pytest.raises(ValueError, match="in flight"):
        cache.reclaim_swap_outs(1)


def test_plan_background_counts_every_pending_reclaim() -> None:
    cache = make("pensieve", gpu=8, cpu=8, threshold=0.5)
    turn(cache, "A", 12, now=0.0)
    turn(cache, "B", 12, now=10.0)
    cache.plan_background(now=20.0)
    cache.take_swap_plan()
    cache.reclaim_swap_outs(1)
    cache.begin_step()
    cache.plan_background(now=21.0)  # 2 free + 2 pending = the threshold: nothing more
    assert cache.take_swap_plan().is_empty


def test_cancelled_background_swap_out_frees_its_gpu_block_at_once() -> None:
    """A chunk swapped out in the background and dropped in the same step never copies: its
    GPU block is free at once, not held for a copy that is not issued."""
    cache = make("pensieve", gpu=8, cpu=2, threshold=0.75)
    turn(cache, "A", 12, now=0.0)
    turn(cache, "B", 12, now=10.0)
    cache.plan_background(now=20.0)  # A0, A1 cancelled (dropped), A2 and B0 copied
    plan = cache.take_swap_plan()
    assert [g for g, _ in plan.swap_out] == [2, 3]
    assert cache.gpu.num_free_blocks == 4  # 2 free before + A0's and A1's blocks
    cache.reclaim_swap_outs(0)
    assert cache.gpu.num_free_blocks == 6
    cache.check_integrity()


class _CopyingExecutor:
    """An executor whose background copies finish only when a step waits for them: a step
    without requests (the runner then waits), or ``finish_every`` steps after they start."""

    def __init__(self, finish_every: int) -> None:
        self.clock = 0.0
        self.tiers = TierSizes(10**6, 10**6, 0)
        self.finish_every = finish_every
        self.num_steps = 0
        self.in_flight: list[int] = []  # step of each batch in flight
        self.reports: list[int] = []
        self.empty_steps = 0

    def execute(self, sched):  # noqa: ANN001, ANN201
        self.clock += 1.0
        if sched.swaps.swap_out:
            self.in_flight.append(self.num_steps)
        if not sched.requests:
            self.empty_steps += 1
            self.in_flight = []
        while self.in_flight and self.num_steps - self.in_flight[0] >= self.finish_every:
            self.in_flight.pop(0)
        self.reports.append(len(self.in_flight))
        self.num_steps += 1
        return RunnerOutput({s.request_id: 1 for s in sched.requests if s.sample},
                            swap_outs_in_flight=len(self.in_flight))

    def stats(self):  # noqa: ANN201
        return {}

    def shutdown(self) -> None:
        pass


def _CopyingEngine(cache: TieredKVCache, finish_every: int):  # noqa: ANN202, N802
    ex = _CopyingExecutor(finish_every)
    eng = EngineCore(Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4,
                                               max_model_len=256), cache), ex,
                     clock=lambda: ex.clock)
    eng.audit = True
    return eng, ex


def test_engine_runs_an_empty_step_to_reclaim_instead_of_stalling() -> None:
    """Every free GPU block is pending reclaim and the next turn needs them: the engine runs a
    step without requests (the runner waits for the copies, reports 0) instead of raising."""
    cache = TieredKVCache(16, 16, cost, unshared(4, swap_out_threshold=0.5,
                                                 decode_reserve=0.0))
    eng, ex = _CopyingEngine(cache, finish_every=10**9)  # copies never finish on their own
    eng.add_request("a", [1] * 39, SamplingParams(max_tokens=1), conversation_id="A")
    while eng.has_unfinished():
        eng.step()  # A: 10 blocks, then idle; 6 free < 8: 2 of A's go in the background
    eng.add_request("b", [2] * 60, SamplingParams(max_tokens=4), conversation_id="B")
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        assert steps < 50
    assert ex.empty_steps >= 1
    assert cache.stats.swapped_out_tokens > 0
    cache.check_integrity()


def test_engine_reclaims_exactly_as_reported() -> None:
    """Copies that finish two steps after they start: blocks come back exactly then."""
    cache = TieredKVCache(32, 32, cost, unshared(4, swap_out_threshold=0.5,
                                                 decode_reserve=0.0))
    eng, ex = _CopyingEngine(cache, finish_every=2)
    for k in range(6):
        eng.add_request(f"r{k}", [k + 1] * 17, SamplingParams(max_tokens=3),
                        conversation_id=f"c{k}")
    pending: list[int] = []
    while eng.has_unfinished():
        eng.step()
        pending.append(len(cache.store._reclaim_groups))
        assert pending[-1] == ex.reports[-1]
    assert max(ex.reports) >= 1


# --------------------------------------------------------------------------- swap or recompute
def _with_cpu_chunks(swap_chunk_s: float | None) -> tuple[TieredKVCache, Request]:
    """A (3 chunks, kv_end 12) entirely on the CPU, ready for its next turn of 2 tokens."""
    cache = make("pensieve", gpu=12, cpu=12, threshold=0.0, swap_chunk_s=swap_chunk_s)
    turn(cache, "A", 12, now=0.0)
    turn(cache, "B", 12, now=1.0)
    cache.store.evict_gpu(3, now=2.0, urgent=False)  # A's three chunks
    cache.take_swap_plan()
    cache.reclaim_swap_outs(0)
    cache.begin_step()
    conv = cache.conversations["A"]
    assert tiers(cache, "A") == ["cpu"] * 3
    req = Request("A2", conv.token_ids + [2, 3], SamplingParams(), conversation_id="A")
    req.pending = cache.pending_for(req, conv)
    return cache, req


@pytest.mark.parametrize(("swap_chunk_s", "spare", "swapped", "pending"), [
    (None, None, [0, 1, 2], [(12, 15)]),       # always swap
    (0.0, None, [0, 1, 2], [(12, 15)]),        # free copies: swap
    (0.5, None, [0, 1], [(8, 15)]),            # 1.04 > 0.5, 1.08 > 1.0, 1.12 < 1.5: recompute
    (100.0, None, [], [(0, 15)]),              # slow link: recompute all
    (100.0, 4, [1, 2], [(0, 4), (12, 15)]),    # ...but only what fits the step's spare tokens
])
def test_admit_swaps_or_recomputes_by_cost(swap_chunk_s: float | None, spare: int | None,
                                           swapped: list[int],
                                           pending: list[tuple[int, int]]) -> None:
    cache, req = _with_cpu_chunks(swap_chunk_s)
    conv = cache.conversations["A"]
    cpu_before = cache.cpu.num_free_blocks
    assert cache.admit(req, conv, 15, now=3.0, spare_tokens=spare)
    plan = cache.take_swap_plan()
    assert [conv.block_table.index(g) for _, g in plan.swap_in] == swapped
    assert req.pending == pending
    recomputed = 4 * (3 - len(swapped))
    st = req.cache_stats
    assert (st.cpu_hit_tokens, st.swapped_in_tokens) == (4 * len(swapped),) * 2
    assert (st.recomputed_tokens, st.cpu_recomputed_tokens) == (recomputed, recomputed)
    assert cache.cpu.num_free_blocks == cpu_before + 3 - len(swapped)  # recomputed: freed now
    cache.check_integrity()


def test_congested_link_pushes_toward_recompute() -> None:
    """The same chunks and rate as the 0.5 s case above, with 2 background swap-outs still in
    flight ahead of them on the copy stream: only the first is swapped in."""
    cache, req = _with_cpu_chunks(0.5)
    cache.store._reclaim_groups.append([])  # stand-ins for two blocks still copying out
    cache.store._reclaim_group_blocks = 2
    conv = cache.conversations["A"]
    assert cache.admit(req, conv, 15, now=3.0)
    # 1.04 < 0.5 * 3 = 1.5: recompute; then 1.04 + 1.08 > 1.5: swap; 2.12 > 2.0: swap
    assert [conv.block_table.index(g) for _, g in cache.take_swap_plan().swap_in] == [1, 2]
    assert req.pending == [(0, 4), (12, 15)]


def test_recomputing_a_chunk_cancels_its_swap_out_of_this_step() -> None:
    """A chunk evicted urgently this step and admitted again in the same step, recomputed:
    its copy is cancelled and the counters say it never left."""
    cache = make("pensieve", gpu=6, cpu=6, threshold=0.0, swap_chunk_s=100.0)
    turn(cache, "A", 8, now=0.0)  # 2 chunks (blocks 0, 1), idle
    conv_b = cache.conversation("B")
    b = Request("B1", [5] * 24, SamplingParams(), conversation_id="B")
    b.pending = cache.pending_for(b, conv_b)
    assert cache.admit(b, conv_b, 24, now=1.0)  # 6 blocks, 4 free: A's 2 chunks go urgently
    assert tiers(cache, "A") == ["cpu", "cpu"] and cache.stats.swapped_out_tokens == 8
    cache.abort_turn(b, conv_b, now=1.5)  # B gives its blocks back
    conv = cache.conversations["A"]
    a = Request("A2", conv.token_ids + [1], SamplingParams(), conversation_id="A")
    a.pending = cache.pending_for(a, conv)
    assert cache.admit(a, conv, a.num_tokens, now=2.0)
    plan = cache.take_swap_plan()
    assert plan.swap_out_first == [] and plan.swap_in == []
    assert cache.stats.swapped_out_tokens == 0 and a.cache_stats.cpu_recomputed_tokens == 8
    cache.check_integrity()


def test_scheduler_recomputes_only_within_the_step_budget() -> None:
    """The scheduler passes the budget left beyond the turn's share: CPU chunks are recomputed
    only as far as they fit this step, the rest are swapped in, and the step stays in budget."""
    cache, _ = _with_cpu_chunks(100.0)
    conv = cache.conversations["A"]
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_model_len=64), cache)
    req = Request("A2", conv.token_ids + [2, 3], SamplingParams(max_tokens=1),
                  conversation_id="A")
    s.add_request(req)
    out = s.schedule(now=5.0)
    (sr,) = out.requests
    # 3 tokens of the turn (12..14) + 5 spare: chunk 0 (4 tokens) recomputed, 1 and 2 swapped
    assert [(r.start_pos, r.query_len) for r in sr.ranges] == [(0, 4), (12, 3)]
    assert sr.num_scheduled_tokens == 7 and sr.sample
    assert len(out.swaps.swap_in) == 2
    assert req.cache_stats.cpu_recomputed_tokens == 4
    done = s.update_from_output(out, RunnerOutput({"A2": 9}), now=6.0)
    assert [r.request_id for r in done] == ["A2"]
    cache.check_integrity()


@pytest.mark.parametrize("policy", ["pensieve", "prefix-lru"])
def test_queued_conversation_kept_over_thinking_ones(policy: str) -> None:
    """Pensieve keeps the KV of a conversation whose next turn waits in the queue (it is what
    the next admissions need) and evicts conversations that are only thinking first, even
    when its own retention value is the lowest; among queued ones the most recently queued
    goes first. The prefix-cache baseline knows nothing of the queue (LRU as before)."""
    cache = make(policy)
    cache.begin_step()
    turn(cache, "A", 12, now=0.0)   # idle longest: lowest value, least recently used
    turn(cache, "B", 12, now=10.0)
    cache.take_swap_plan()
    cache.set_queued(cache.conversations["A"], 15.0)  # A's next turn arrives and waits
    cache.check_integrity()
    cache.plan_background(now=20.0)
    cache.take_swap_plan()
    if policy == "pensieve":
        assert tiers(cache, "A") == ["gpu", "gpu", "gpu"]
        assert tiers(cache, "B") == ["cpu", "cpu", "gpu"]
    else:
        assert tiers(cache, "A") == ["gpu", "cpu", "cpu"]  # tail first, A least recent
    cache.check_integrity()
    # no longer queued (e.g. the turn was aborted): back to the policy's order
    cache.set_queued(cache.conversations["A"], None)
    cache.check_integrity()


def test_queued_order_most_recent_first() -> None:
    cache = make("pensieve", gpu=8, cpu=8)
    cache.begin_step()
    turn(cache, "A", 12, now=0.0)
    turn(cache, "B", 12, now=10.0)
    cache.take_swap_plan()
    cache.set_queued(cache.conversations["A"], 11.0)
    cache.set_queued(cache.conversations["B"], 12.0)  # queued later: admitted later
    cache.plan_background(now=20.0)
    cache.take_swap_plan()
    assert tiers(cache, "B") == ["cpu", "cpu", "gpu"]
    assert tiers(cache, "A") == ["gpu", "gpu", "gpu"]
    cache.check_integrity()


def test_scheduler_marks_queued_turns() -> None:
    cache = make("pensieve", gpu=16, cpu=8)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), cache)
    p = SamplingParams(max_tokens=1, ignore_eos=True)
    sched.add_request(Request("r1", [1] * 8, p, arrival_time=1.0, conversation_id="c"))
    conv = cache.conversations["c"]
    assert conv.queued_at == 1.0
    out = sched.schedule(now=2.0)
    assert conv.queued_at is None and conv.running
    sched.update_from_output(out, RunnerOutput({"r1": 5}), now=3.0)
    assert not conv.running and conv.queued_at is None
    sched.add_request(Request("r2", [*conv.token_ids, 2, 2], p, arrival_time=4.0,
                              conversation_id="c"))
    assert conv.queued_at == 4.0
    sched.abort_request("r2", now=5.0)
    assert conv.queued_at is None
    cache.check_integrity()


# --------------------------------------------------------------------------- swap-ins ahead
def test_swap_in_ahead_keeps_cpu_blocks_one_step_longer() -> None:
    """Swap-ins moved ahead leave the step's ``swap_in`` for ``swap_in_ahead``; their CPU blocks
    are freed at the second step after, ordinary swap-ins' at the next."""
    cache, req = _with_cpu_chunks(None)
    conv = cache.conversations["A"]
    free0 = cache.cpu.num_free_blocks
    since = cache.num_planned_swap_ins
    assert cache.admit(req, conv, 15, now=3.0)
    assert cache.swap_in_ahead(since) == 3
    plan = cache.take_swap_plan()
    assert plan.swap_in == [] and len(plan.swap_in_ahead) == 3
    assert [g for _, g in plan.swap_in_ahead] == list(conv.block_table[:3])
    cache.check_integrity()
    cache.begin_step()
    assert cache.cpu.num_free_blocks == free0  # the copies may still run during this step
    cache.check_integrity()
    cache.begin_step()
    assert cache.cpu.num_free_blocks == free0 + 3
    cache.check_integrity()


def _decoding_and_waiting(ahead_chunks: int) -> tuple[Scheduler, Request]:
    """B decodes; A (3 chunks on the CPU) has a turn waiting."""
    cache, _ = _with_cpu_chunks(None)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64,
                                  swap_in_ahead_chunks=ahead_chunks), cache)
    conv_b = cache.conversations["B"]
    s.add_request(Request("B2", conv_b.token_ids + [4], SamplingParams(max_tokens=5),
                          conversation_id="B"))
    out = s.schedule(now=3.0)
    s.update_from_output(out, RunnerOutput({"B2": 7}), now=3.1)
    conv = cache.conversations["A"]
    a = Request("A2", conv.token_ids + [2, 3], SamplingParams(max_tokens=1), conversation_id="A")
    s.add_request(a)
    return s, a


def test_turn_with_swap_ins_computes_the_step_after_its_copies() -> None:
    s, a = _decoding_and_waiting(ahead_chunks=256)
    out = s.schedule(now=4.0)
    assert [r.request_id for r in out.requests] == ["B2"]  # A admitted, not computed
    assert out.swaps.swap_in == [] and len(out.swaps.swap_in_ahead) == 3
    assert a in s.running and a.cache_stats.swapped_in_tokens == 12
    s.update_from_output(out, RunnerOutput({"B2": 7}), now=4.1)
    out = s.schedule(now=4.2)
    (sa,) = [r for r in out.requests if r.request_id == "A2"]
    assert [(r.start_pos, r.query_len) for r in sa.ranges] == [(12, 3)] and sa.sample
    assert out.swaps.swap_in == [] and out.swaps.swap_in_ahead == []
    s.cache.check_integrity()


@pytest.mark.parametrize("ahead_chunks", [0, 2])
def test_swap_ins_over_the_ahead_limit_compute_at_once(ahead_chunks: int) -> None:
    s, _ = _decoding_and_waiting(ahead_chunks)
    out = s.schedule(now=4.0)
    assert sorted(r.request_id for r in out.requests) == ["A2", "B2"]
    assert len(out.swaps.swap_in) == 3 and out.swaps.swap_in_ahead == []


def test_turn_alone_is_not_deferred() -> None:
    """Nothing else to compute in the step: the turn computes at once, layers waiting for
    their swap-ins (deferring would only add an empty step)."""
    cache, _ = _with_cpu_chunks(None)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), cache)
    conv = cache.conversations["A"]
    s.add_request(Request("A2", conv.token_ids + [2], SamplingParams(max_tokens=1),
                          conversation_id="A"))
    out = s.schedule(now=4.0)
    assert [r.request_id for r in out.requests] == ["A2"]
    assert len(out.swaps.swap_in) == 3 and out.swaps.swap_in_ahead == []


@pytest.mark.parametrize("may_defer", [True, False])
def test_deferred_admission_waits_for_background_swap_outs(may_defer: bool) -> None:
    """A turn short of GPU blocks, with other turns running (``may_defer``), starts background
    swap-outs for what it lacks and waits; once they are reclaimed it is admitted with no
    urgent swap-out. Without ``may_defer`` (or past its deferrals) the swap-outs are urgent."""
    cache = make("pensieve", gpu=8, cpu=8, threshold=0.0, defer_admission=1)
    cache.begin_step()
    turn(cache, "A", 12, now=0.0)  # 3 chunks
    turn(cache, "B", 12, now=1.0)  # 3 chunks: 2 GPU blocks free
    cache.take_swap_plan()
    req, conv = new_turn(cache, "C", 16, now=2.0)  # needs 4 blocks: 2 short
    admitted = cache.admit(req, conv, req.num_tokens, 2.0, may_defer=may_defer)
    plan = cache.take_swap_plan()
    cache.check_integrity()
    if not may_defer:
        assert admitted and len(plan.swap_out_first) == 2 and not plan.swap_out
        return
    assert not admitted and req.deferrals == 1 and not conv.running
    assert len(plan.swap_out) == 2 and not plan.swap_out_first  # A's leading chunks
    assert tiers(cache, "A") == ["cpu", "cpu", "gpu"]
    cache.begin_step()
    # still copying: a second try is past the deferrals, so it evicts urgently
    again = cache.admit(req, conv, req.num_tokens, 2.1, may_defer=True)
    assert again and len(cache.take_swap_plan().swap_out_first) == 2
    cache.check_integrity()


def test_deferred_admission_is_admitted_once_the_copies_are_done() -> None:
    cache = make("pensieve", gpu=8, cpu=8, threshold=0.0, defer_admission=2)
    cache.begin_step()
    turn(cache, "A", 12, now=0.0)
    turn(cache, "B", 12, now=1.0)
    cache.take_swap_plan()
    req, conv = new_turn(cache, "C", 16, now=2.0)
    assert not cache.admit(req, conv, req.num_tokens, 2.0, may_defer=True)
    assert len(cache.take_swap_plan().swap_out) == 2
    cache.begin_step()
    # copies in flight: the blocks being reclaimed cover the shortfall, nothing more moves
    assert not cache.admit(req, conv, req.num_tokens, 2.1, may_defer=True)
    assert cache.take_swap_plan().is_empty and req.deferrals == 2
    cache.reclaim_swap_outs(0)  # the runner reports the copies done
    cache.begin_step()
    assert cache.admit(req, conv, req.num_tokens, 2.2, may_defer=True)
    plan = cache.take_swap_plan()
    assert not plan.swap_out_first and not plan.swap_out
    cache.check_integrity()


# --------------------------------------------------------------------------- construction
def test_settings_are_constructor_arguments_and_parts_are_composed() -> None:
    """``defer_admission`` is given when the cache is built (and checked there); the cache
    holds its index and store, which share one index and one conversations map."""
    cache = make("pensieve", defer_admission=3)
    assert cache.defer_admission == 3
    assert cache.store.index is cache.index
    assert cache.index.conversations is cache.conversations
    assert cache.gpu is cache.store.gpu and cache.stats is cache.store.stats
    for bad in (-1, True):
        with pytest.raises(ValueError, match="defer_admission"):
            make("pensieve", defer_admission=bad)


def test_decode_step_times_are_averaged_into_step_overlap() -> None:
    cache = make("pensieve")
    assert cache.step_overlap_s == 0.0
    cache.observe_decode_step(0.010)  # the first sets it
    assert cache.step_overlap_s == 0.010
    cache.observe_decode_step(0.020)  # then a moving average (weight 0.2)
    assert cache.step_overlap_s == pytest.approx(0.012)
