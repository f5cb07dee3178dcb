"""The disk tier's bookkeeping (pure Python): random workloads through all three tiers and
restarts, on a fake executor and a fake disk that carry, for every slot, which tokens its KV was
computed from. Every step checks that attention reads only KV of the request's own tokens
(so a chunk from disk is never wrong KV), the cache's integrity, the disk index's invariants,
and that the files on the fake disk are exactly the index's entries."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pensieve.core.cache_config import CacheConfig
from pensieve.core.conversation import Tier
from pensieve.core.disk_index import (
    DiskEntry,
    DiskIndex,
    found_key,
    partial_hash,
    spill_idle,
    spilled_key,
)
from pensieve.core.disk_restore import worth_reading
from pensieve.core.eviction import get_policy
from pensieve.core.outputs import DiskPlan, RunnerOutput, SchedulerOutput
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.scheduler import Scheduler
from pensieve.core.scheduling_config import SchedulerConfig
from pensieve.core.tiered_cache import TieredKVCache
from pensieve.engine.engine_core import EngineCore
from pensieve.engine.executor import TierSizes

C = 4
GPU, CPU = 24, 6


def tag(tokens: list[int], p: int, salt: bytes = b"") -> str:
    """What the KV at position ``p`` depends on: the tokens up to it; and, so that KV of
    another tenant (salt) is never taken for one's own, the request's salt."""
    return hashlib.blake2b(salt + repr(tokens[:p + 1]).encode(), digest_size=8).hexdigest()


class FakeExecutor:
    """Slots hold the tag of the KV written there; copies move tags; compute writes the tags
    of its positions and checks every position it attends to."""

    def __init__(self, engine: Callable[[], EngineCore]) -> None:
        self.tiers = TierSizes(GPU, CPU, 1)
        self.gpu: dict[int, list[str | None]] = {b: [None] * C for b in range(GPU)}
        self.cpu: dict[int, list[str | None]] = {b: [None] * C for b in range(CPU)}
        self.engine = engine
        self.checked = 0

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        sw = sched.swaps
        for g, c in sw.swap_out_first:
            self.cpu[c] = list(self.gpu[g])
        for c, g in sw.swap_in + sw.swap_in_ahead:
            self.gpu[g] = list(self.cpu[c])
        for g, c in sw.swap_out:
            self.cpu[c] = list(self.gpu[g])
        sampled = {}
        for s in sched.requests:
            req = self.engine().scheduler.requests[s.request_id]
            tokens = req.all_token_ids
            table = s.block_table
            for r in s.ranges:
                for p in range(r.start_pos, r.end_pos):
                    self.gpu[table[p // C]][p % C] = tag(tokens, p, req.share_salt)
            end = max(r.end_pos for r in s.ranges)
            for p in range(end):  # attention reads every position up to the last
                assert self.gpu[table[p // C]][p % C] == tag(tokens, p, req.share_salt), \
                    (s.request_id, p)
                self.checked += 1
            if s.sample:
                sampled[s.request_id] = 3 + int(tag(tokens, end - 1), 16) % 50
        return RunnerOutput(sampled, swap_outs_in_flight=0)

    def stats(self) -> dict[str, int]:
        return {}

    def shutdown(self) -> None:
        pass


class FakeDisk:
    """Files as ``name -> (entry fields, slot tags)``; reads are done at once, the results
    handed over at ``collect`` as the real tier does."""

    def __init__(self, files: dict[str, tuple[tuple[str, int, int, str], list[str | None]]],
                 corrupt: set[str], ex: FakeExecutor, capacity: int,
                 writes: dict[str, int]) -> None:
        self.files, self.corrupt, self.ex = files, corrupt, ex
        self.index = DiskIndex(capacity, C)
        self.index.read_chunk_s = None
        self.loaded: dict[str, list[str | None]] = {}
        self.done: list[tuple[DiskEntry, bool]] = []
        self.reads: list[tuple[str, int]] = []
        """Every file read, in order: (conversation whose turn read it, chunk)."""
        self.writes: dict[str, int] = writes
        """Writes of each file name (over restarts)."""
        self.ahead: set[str] = set()
        """Files written ahead of their chunk's spill (``DiskPlan.ahead``)."""
        for t, (_name, (head, _)) in enumerate(sorted(files.items())):
            if self.index.size < capacity:
                e = DiskEntry(*head, key=found_key(float(t)))
                self.index.add(e)
                if e.conversation_id:
                    self.index.hold(e.conversation_id, e.index, e)

    def prefetch(self, conversation_id: str, tokens: list[int] | None = None,
                 salt: bytes = b"", dropped: list[int] | None = None,
                 hashes: list[bytes] | None = None,
                 cache: TieredKVCache | None = None) -> None:
        """As ``DiskTier.prefetch``: which files a turn reads, by ``cache``'s costs."""
        entries = (self.index.of(conversation_id) if tokens is None else
                   self.index.wanted(conversation_id, tokens, salt, len(tokens) - 1, dropped,
                                     hashes))
        for e in entries:
            if e.ready or (cache is not None
                           and not worth_reading(cache, e, self.index.read_chunk_s)):
                continue
            self.reads.append((conversation_id, e.index))
            f = self.files.get(e.name)
            ok = (f is not None and e.name not in self.corrupt
                  and f[0] == (e.conversation_id, e.index, e.tokens, e.prefix_hash))
            if ok and f is not None:
                self.loaded[e.name] = list(f[1])
            self.done.append((e, ok))

    def collect(self, wait: bool = True) -> None:  # reads are instant here
        for e, ok in self.done:
            self.index.set_ready(e, ok)  # no-op if dropped since
        self.done.clear()

    def apply(self, plan: DiskPlan | None = None,
              sync: Callable[[], None] | None = None) -> None:
        plan = self.index.take_plan() if plan is None else plan
        writes = [(e, list((self.ex.gpu if g else self.ex.cpu)[b])) for g, b, e in plan.writes]
        writes += [(e, list(self.ex.cpu[b])) for b, e in plan.ahead]  # the chunk stays there
        self.ahead |= {e.name for _, e in plan.ahead}
        for e, b in plan.reads:
            self.ex.cpu[b] = list(self.loaded[e.name])  # kept, as DiskTier keeps restored
        for name in plan.deletes:
            self.files.pop(name, None)
            self.loaded.pop(name, None)
            self.corrupt.discard(name)
        for e, tags in writes:
            assert e.name not in self.files, e.name  # a file is written once while on disk
            self.writes[e.name] = self.writes.get(e.name, 0) + 1
            self.files[e.name] = ((e.conversation_id, e.index, e.tokens, e.prefix_hash), tags)
            self.corrupt.discard(e.name)

    def publish(self, cache: TieredKVCache, finished: object) -> None:
        pass  # no shared store

    def close(self, cache: TieredKVCache | None) -> None:
        self.apply()
        if cache is not None:  # as DiskTier.close: every idle chunk not on disk yet
            spill_idle(self.index, cache.conversations.values(), C, cache.index.key_now,
                       self.apply)

    def stats(self) -> dict[str, int]:
        return {}


class World:
    def __init__(self, capacity: int, across_tenants: bool = False) -> None:
        self.across_tenants = across_tenants
        self.files: dict[str, tuple[tuple[str, int, int, str], list[str | None]]] = {}
        self.corrupt: set[str] = set()
        self.writes: dict[str, int] = {}
        self.capacity = capacity
        self.histories: dict[str, list[int]] = {}
        self.start()

    def start(self) -> None:
        self.ex = FakeExecutor(lambda: self.eng)
        self.disk = FakeDisk(self.files, self.corrupt, self.ex, self.capacity, self.writes)
        cache = TieredKVCache(GPU, CPU, lambda n: 1.0 + 0.01 * n,
                              CacheConfig(chunk_size=C, swap_out_threshold=0.3,
                                          decode_reserve=0.0, share_prefixes=False,
                                          defer_admission=0,
                                          share_prefixes_across_tenants=self.across_tenants),
                              policy=get_policy("pensieve"), disk=self.disk.index)
        self.clock = 0.0
        self.eng = EngineCore(Scheduler(SchedulerConfig(max_num_batched_tokens=32,
                                                        max_num_seqs=3, max_model_len=80), cache),
                              self.ex, clock=lambda: self.clock, disk=self.disk)
        self.eng.audit = True
        for cid, hist in self.histories.items():
            self.eng.restore_conversation(cid, hist)

    def restart(self) -> None:
        self.eng.shutdown()
        self.start()

    def check(self) -> None:
        index, cache = self.disk.index, self.eng.cache
        assert self.eng.failed_requests == 0  # containment turns a failed check into this
        index.check()
        for cid, entries in index.entries.items():
            conv = cache.conversations.get(cid)
            if conv is None or not conv.chunks:
                continue
            for i in entries:
                assert i < len(conv.chunks) and conv.chunks[i].tier is Tier.DISK, (cid, i)
        assert set(index.files) == set(self.files), (set(index.files) ^ set(self.files))
        for e in index.files.values():  # one tenant's (salt's) holders per file
            assert len({index.salts.get(c) for c in e.holders}) <= 1, e

    def run_all(self) -> None:
        while self.eng.has_unfinished():
            self.clock += 1.0
            self.eng.step()
            self.check()
        for cid in list(self.histories):
            self.histories[cid] = self.eng.conversation_history(cid)


SYSTEM = [7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47]
"""A system prompt (three chunks of C)."""


@st.composite
def workloads(draw: st.DrawFn) -> tuple[int, bool, list[tuple[str, int, int]]]:
    seed = draw(st.integers(0, 10**6))
    rng = random.Random(seed)
    ops: list[tuple[str, int, int]] = []
    for _ in range(draw(st.integers(3, 14))):
        kind = rng.choices(["turns", "restart", "edited", "corrupt", "delete"],
                           [6, 2, 2, 1, 1])[0]
        ops.append((kind, rng.randrange(10**6), rng.randint(1, 5)))
    return draw(st.sampled_from([0, 3, 12, 200])), draw(st.booleans()), ops


@settings(max_examples=40, deadline=None, derandomize=True)
@given(w=workloads())
def test_random_workloads_keep_the_disk_tier_consistent(
        w: tuple[int, bool, list[tuple[str, int, int]]]) -> None:
    capacity, across, ops = w
    world = World(capacity, across)
    lengths: dict[str, int] = {}
    for kind, seed, k in ops:
        rng = random.Random(seed)
        if kind == "turns":
            for c in rng.sample(range(6), k):
                cid = f"c{c}"
                new, m = rng.randint(1, 14), rng.randint(1, 5)
                # most conversations open with one of two system prompts (shared prefixes,
                # within a tenant and, as tokens, across the two tenants)
                head = SYSTEM[:rng.choice([0, 9, 12])] if cid not in lengths else []
                if rng.random() < 0.3:
                    head = [3] + head[1:]
                if lengths.get(cid, 0) + len(head) + new + m > 72:
                    continue
                lengths[cid] = lengths.get(cid, 0) + len(head) + new + m
                world.histories.setdefault(cid, [])
                world.eng.add_request(f"{cid}@{world.clock}", head + [rng.randrange(3, 60)
                                                                     for _ in range(new)],
                                      SamplingParams(max_tokens=m, ignore_eos=True),
                                      conversation_id=cid, tenant=f"t{c % 2}")
            world.run_all()
        elif kind == "restart":
            world.restart()
            world.check()
        elif kind == "edited" and any(world.histories.values()):
            # the store comes back with another history for one conversation (an edit):
            # its copies on disk are of other tokens and must not be used
            cid = rng.choice(sorted(c for c, h in world.histories.items() if h))
            hist = world.histories[cid]
            hist[rng.randrange(len(hist))] = rng.randrange(60, 64)
            world.restart()
            world.check()
        elif kind == "corrupt" and world.files:
            world.corrupt.add(rng.choice(sorted(world.files)))
        elif kind == "delete" and world.histories:
            cid = rng.choice(sorted(world.histories))
            world.eng.delete_conversation(cid)
            del world.histories[cid]
            lengths.pop(cid, None)
            world.disk.apply()
            world.check()


def test_disk_reads_happen_and_slow_disk_recomputes() -> None:
    """One conversation pushed to disk by others comes back from it; with a disk slower than
    recomputing, it is recomputed instead (and its copies forgotten)."""
    for read_s, want_hit in ((None, True), (10.0, False)):
        world = World(100)
        world.disk.index.read_chunk_s = read_s
        for cid, n in (("a", 40), ("b", 60), ("c", 60), ("a", 4)):
            world.histories.setdefault(cid, [])
            world.eng.add_request(f"{cid}{n}", list(range(3, 3 + n)),
                                  SamplingParams(max_tokens=2, ignore_eos=True),
                                  conversation_id=cid)
            world.run_all()
        st_ = world.eng.cache.stats
        world.check()
        assert st_.disk_written_tokens > 0
        assert (st_.disk_hit_tokens > 0) == want_hit, st_
        assert world.ex.checked > 0


def test_chunks_written_ahead_are_spilled_without_a_second_write() -> None:
    """Steps that spill write the CPU tier's next chunks ahead (their blocks' tags, the chunk
    staying on the CPU): when the order then drops them, the spill holds the file already
    written, and turns that come back read it (every position's tag checked)."""
    world = World(100)
    for cid, n in (("a", 40), ("b", 30), ("c", 30), ("d", 30), ("a", 4), ("b", 4)):
        world.histories.setdefault(cid, [])
        world.eng.add_request(f"{cid}{n}", list(range(3, 3 + n)),
                              SamplingParams(max_tokens=2, ignore_eos=True),
                              conversation_id=cid)
        world.run_all()
    index = world.disk.index
    ahead = world.disk.ahead
    assert ahead and all(world.writes[name] == 1 for name in ahead)
    assert any(e.holders and e.name in ahead for e in index.files.values())  # spilled since
    assert all(not e.holders for e in index.files.values() if e.ahead)
    st_ = world.eng.cache.stats
    assert st_.disk_hit_tokens > 0 and world.ex.checked > 0


def test_a_chunk_written_ahead_is_held_by_its_spill_or_let_go_at_admission() -> None:
    """An entry written ahead is held by no one, keyed as spilled, its write planned ahead;
    its chunk's spill then holds it without a write; a conversation admitted (or deleted)
    before that lets its entries go: first in the disk's order."""
    index = DiskIndex(4, C)
    a, b = _full(0, 5.0), _full(1, 6.0)
    assert index.store_ahead("x", a, 3) and index.store_ahead("y", b, 4)
    plan = index.take_plan()
    assert plan.ahead == [(3, a), (4, b)] and not plan.writes
    assert a.ahead and not a.holders and a.key[0] == 1
    index.check()
    assert index.store("x", _full(0, 7.0), 3, False)  # its spill: held, no second write
    assert index.get("x", 0) is a and not a.ahead and a.key[2][0] == 7.0
    assert not index.take_plan().writes
    index.let_go_ahead("x")  # spilled since: kept as held
    assert a.key[2][0] == 7.0 and a.holders == {"x"}
    index.let_go_ahead("y")  # y came back first: its file goes first
    assert not b.ahead and not b.holders and b.key[0] == -1
    index.check()


def test_partial_hash_chains_onto_the_full_chunks() -> None:
    salt, other = b"s" * 16, b"t" * 16
    assert partial_hash([], salt, [1, 2]) != partial_hash([], other, [1, 2])  # salted
    assert partial_hash([b"a" * 16], salt, [1, 2]) != partial_hash([b"b" * 16], salt, [1, 2])
    assert partial_hash([b"a" * 16], salt, [1, 2]) == partial_hash([b"a" * 16], other, [1, 2])


def _full(i: int, k: float) -> DiskEntry:
    return DiskEntry("", i, C, f"{i:032x}", key=spilled_key((k, 0.0, "", 0.0)))


def test_full_index_evicts_lowest_key_and_refuses_lower() -> None:
    index = DiskIndex(2, C)
    for i, k in enumerate((5.0, 7.0)):
        assert index.store(f"x{i}", _full(i, k), i, False)
    assert not index.store("y", _full(2, 1.0), 2, False)
    assert index.store("y", _full(3, 6.0), 3, False)
    assert index.get("x0", 0) is None and index.get("x1", 1) is not None
    assert index.take_plan().deletes == [_full(0, 0.0).name]
    index.check()


def test_a_spilled_copy_already_on_disk_only_gains_a_holder() -> None:
    """Equal hashes: one file, written once, held by both; the key is the higher of the two;
    the last holder letting go keeps the file (first to be evicted), a partial one's goes."""
    index = DiskIndex(4, C)
    assert index.store("a", _full(0, 5.0), 0, False)
    assert index.store("b", _full(0, 9.0), 3, True)
    plan = index.take_plan()
    assert [(g, b, e.name) for g, b, e in plan.writes] == [(False, 0, _full(0, 0).name)]
    e = index.get("a", 0)
    assert e is not None and e is index.get("b", 0) and e.holders == {"a", "b"}
    assert e.key == spilled_key((9.0, 0.0, "", 0.0))
    part = DiskEntry("a", 1, 2, "p", key=spilled_key((1.0, 0.0, "", 0.0)))
    assert index.store("a", part, 1, False)
    index.check()
    index.release_from("a", 0)
    assert e.holders == {"b"} and index.take_plan().deletes == [part.name]
    index.release("b", 0)
    assert e.holders == set() and index.files == {e.name: e} and e.key[0] == -1
    assert index.store("c", _full(0, 2.0), 1, False)  # back on disk: held, not written
    assert index.get("c", 0) is e and not index.take_plan().writes
    index.check()


def test_read_copies_are_restored_not_recomputed() -> None:
    """Each chunk's read (0.9 s) is cheaper than recomputing it (1 s and more), so the turn
    reads every copy of "a"; they come back at admission as far as CPU blocks go, though
    charging the reads queued before each (0.9 s times 1 + queued) would have let only one
    chunk back per step."""
    world = World(100)
    world.disk.index.read_chunk_s = 0.9
    for cid, n in (("a", 40), ("b", 60), ("c", 60)):
        world.histories.setdefault(cid, [])
        world.eng.add_request(f"{cid}{n}", list(range(3, 3 + n)),
                              SamplingParams(max_tokens=2, ignore_eos=True),
                              conversation_id=cid, tenant=cid)  # nothing shared
        world.run_all()
    on_disk = sorted(world.disk.index.entries.get("a", {}))
    assert len(on_disk) >= 3, on_disk  # several of "a"'s chunks went to disk
    tokens = sum(e.tokens for e in world.disk.index.of("a"))
    before = world.eng.cache.stats.disk_hit_tokens
    world.eng.add_request("a4", [5, 6, 7, 8], SamplingParams(max_tokens=2, ignore_eos=True),
                          conversation_id="a", tenant="a")
    world.run_all()
    st_ = world.eng.cache.stats
    world.check()
    assert sorted(i for c, i in world.disk.reads if c == "a") == on_disk  # the turn read them
    # every copy read came back, as many as the CPU tier's blocks take (each restore is a
    # read into a CPU block); the old charge would have let one chunk back (C tokens)
    assert st_.disk_hit_tokens - before == min(tokens, CPU * C) > 2 * C
    assert world.ex.checked > 0


@pytest.mark.parametrize("across", [False, True])
def test_shared_prefix_written_once_and_resumed_after_a_restart_within_its_tenant(
        across: bool) -> None:
    """Four conversations of tenant t0 open with one system prompt (three chunks); the
    shutdown writes each of its chunks once, held by every conversation whose chunk it is. A
    restarted engine's new conversation of t0 reads the prompt back from disk; one of t1 (the
    same tokens, another salt) recomputes it, unless tenants share (``across``); a corrupted
    file is recomputed too."""
    world = World(200, across)
    for n in range(4):
        world.histories[f"s{n}"] = []
        world.eng.add_request(f"s{n}", SYSTEM + [50 + n, 51, 52], SamplingParams(
            max_tokens=2, ignore_eos=True), conversation_id=f"s{n}", tenant="t0")
        world.run_all()
    index = world.disk.index
    world.restart()  # the shutdown spills every idle chunk
    world.check()
    held = [e for e in index.files.values() if not e.conversation_id and e.index < 3]
    assert [e.holders for e in held] == [{"s0", "s1", "s2", "s3"}] * 3  # one file, 4 holders
    shared = [e for e in world.disk.index.files.values() if not e.conversation_id and
              e.index < 3 and e.name in world.disk.writes]
    assert len(shared) == 3 and all(world.disk.writes[e.name] == 1 for e in shared), shared
    assert sum(world.disk.writes.values()) == len(world.files)  # each file written once
    assert len(world.files) == 3 + 4  # and each conversation's own fourth chunk
    stats = world.eng.cache.stats
    for cid, tenant, want in (("new0", "t0", 3 * C), ("new1", "t1", 3 * C if across else 0)):
        before = stats.disk_hit_tokens
        world.histories[cid] = []
        world.eng.add_request(cid, SYSTEM + [9, 9], SamplingParams(max_tokens=2, ignore_eos=True),
                              conversation_id=cid, tenant=tenant)
        world.run_all()
        assert stats.disk_hit_tokens - before == want, (cid, stats)
    reads = list(world.disk.reads)
    world.eng.add_request("new0+", [5], SamplingParams(max_tokens=2, ignore_eos=True),
                          conversation_id="new0", tenant="t0")
    world.run_all()
    assert world.disk.reads == reads  # its prompt is in the cache: its files are not read
    world.corrupt.update(e.name for e in shared)
    world.restart()
    world.histories["new2"] = []
    before = stats.disk_hit_tokens
    world.eng.add_request("new2", SYSTEM + [8], SamplingParams(max_tokens=2, ignore_eos=True),
                          conversation_id="new2", tenant="t0")
    world.run_all()
    assert world.eng.cache.stats.disk_hit_tokens == 0 and world.ex.checked > 0
