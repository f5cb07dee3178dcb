"""The disk tier's bookkeeping (pure Python): random workloads through all three tiers and
restarts, on a fake executor and a fake disk that carry, for every slot, which tokens its KV was
computed from. Every step checks that attention reads only KV of the request's own tokens
(so a chunk from disk is never wrong KV), the cache's integrity, the disk index's invariants,
and that the files on the fake disk are exactly the index's entries."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from pensieve.core.conversation import Tier
from pensieve.core.disk_index import DiskEntry, DiskIndex, chunk_hashes, found_key
from pensieve.core.disk_restore import worth_reading
from pensieve.core.eviction import get_policy
from pensieve.core.outputs import RunnerOutput, SchedulerOutput
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.scheduler import Scheduler
from pensieve.core.scheduling_config import SchedulerConfig
from pensieve.core.tiered_cache import TieredKVCache
from pensieve.engine.engine_core import EngineCore
from pensieve.engine.executor import TierSizes

C = 4
GPU, CPU = 24, 6


def tag(tokens: list[int], p: int) -> str:
    """What the KV at position ``p`` depends on: the tokens up to it."""
    return hashlib.blake2b(repr(tokens[:p + 1]).encode(), digest_size=8).hexdigest()


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
                    self.gpu[table[p // C]][p % C] = tag(tokens, p)
            end = max(r.end_pos for r in s.ranges)
            for p in range(end):  # attention reads every position up to the last
                assert self.gpu[table[p // C]][p % C] == tag(tokens, p), (s.request_id, p)
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
                 corrupt: set[str], ex: FakeExecutor, capacity: int) -> None:
        self.files, self.corrupt, self.ex = files, corrupt, ex
        self.index = DiskIndex(capacity, C)
        self.index.read_chunk_s = None
        self.loaded: dict[str, list[str | None]] = {}
        self.done: list[tuple[DiskEntry, bool]] = []
        self.worth: Callable[[DiskEntry], bool] | None = None
        """As ``DiskTier.worth``: which files a turn reads (None: every one)."""
        self.reads: list[tuple[str, int]] = []
        """Every file read, in order: (conversation, chunk)."""
        for t, (_name, (head, _)) in enumerate(sorted(files.items())):
            if self.index.size < capacity:
                self.index.add(DiskEntry(*head, key=found_key(float(t))))

    def prefetch(self, conversation_id: str) -> None:
        for e in self.index.of(conversation_id):
            if e.ready or (self.worth is not None and not self.worth(e)):
                continue
            self.reads.append((e.conversation_id, e.index))
            f = self.files.get(e.name)
            ok = (f is not None and e.name not in self.corrupt
                  and f[0] == (e.conversation_id, e.index, e.tokens, e.prefix_hash))
            if ok and f is not None:
                self.loaded[e.name] = list(f[1])
            self.done.append((e, ok))

    def collect(self) -> None:
        for e, ok in self.done:
            if self.index.get(e.conversation_id, e.index) is e:
                self.index.set_ready(e.conversation_id, e.index, ok)
        self.done.clear()

    def apply(self, sync: Callable[[], None] | None = None) -> None:
        plan = self.index.take_plan()
        writes = [(e, list((self.ex.gpu if g else self.ex.cpu)[b])) for g, b, e in plan.writes]
        for e, b in plan.reads:
            self.ex.cpu[b] = self.loaded.pop(e.name)
        for name in plan.deletes:
            self.files.pop(name, None)
            self.loaded.pop(name, None)
            self.corrupt.discard(name)
        for e, tags in writes:
            self.files[e.name] = ((e.conversation_id, e.index, e.tokens, e.prefix_hash), tags)
            self.corrupt.discard(e.name)

    def close(self, cache: TieredKVCache | None) -> None:
        self.apply()

    def stats(self) -> dict[str, int]:
        return {}


class World:
    def __init__(self, capacity: int) -> None:
        self.files: dict[str, tuple[tuple[str, int, int, str], list[str | None]]] = {}
        self.corrupt: set[str] = set()
        self.capacity = capacity
        self.histories: dict[str, list[int]] = {}
        self.start()

    def start(self) -> None:
        cache = TieredKVCache(GPU, CPU, C, get_policy("pensieve"), lambda n: 1.0 + 0.01 * n,
                              swap_out_threshold=0.3, decode_reserve=0.0)
        self.ex = FakeExecutor(lambda: self.eng)
        self.disk = FakeDisk(self.files, self.corrupt, self.ex, self.capacity)
        cache.disk = self.disk.index
        self.disk.worth = lambda e: worth_reading(cache, e, self.disk.index.read_chunk_s)
        self.clock = 0.0
        self.eng = EngineCore(Scheduler(SchedulerConfig(max_num_batched_tokens=32,
                                                        max_num_seqs=3, max_model_len=80), cache),
                              self.ex, clock=lambda: self.clock)
        self.eng.audit = True
        self.eng.disk = self.disk
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
                assert i < len(conv.chunks) and conv.chunks[i].tier is Tier.DROPPED, (cid, i)
        names = {e.name for es in index.entries.values() for e in es.values()}
        assert names == set(self.files), (names ^ set(self.files))

    def run_all(self) -> None:
        while self.eng.has_unfinished():
            self.clock += 1.0
            self.eng.step()
            self.check()
        for cid in list(self.histories):
            self.histories[cid] = self.eng.conversation_history(cid)


@st.composite
def workloads(draw: st.DrawFn) -> tuple[int, list[tuple[str, int, int]]]:
    seed = draw(st.integers(0, 10**6))
    rng = random.Random(seed)
    ops: list[tuple[str, int, int]] = []
    for _ in range(draw(st.integers(3, 14))):
        kind = rng.choices(["turns", "restart", "edited", "corrupt", "delete"],
                           [6, 2, 2, 1, 1])[0]
        ops.append((kind, rng.randrange(10**6), rng.randint(1, 5)))
    return draw(st.sampled_from([0, 3, 12, 200])), ops


@settings(max_examples=40, deadline=None, derandomize=True)
@given(w=workloads())
def test_random_workloads_keep_the_disk_tier_consistent(
        w: tuple[int, list[tuple[str, int, int]]]) -> None:
    capacity, ops = w
    world = World(capacity)
    lengths: dict[str, int] = {}
    for kind, seed, k in ops:
        rng = random.Random(seed)
        if kind == "turns":
            for c in rng.sample(range(6), k):
                cid = f"c{c}"
                new, m = rng.randint(1, 14), rng.randint(1, 5)
                if lengths.get(cid, 0) + new + m > 72:
                    continue
                lengths[cid] = lengths.get(cid, 0) + new + m
                world.histories.setdefault(cid, [])
                world.eng.add_request(f"{cid}@{world.clock}", [rng.randrange(3, 60)
                                                              for _ in range(new)],
                                      SamplingParams(max_tokens=m, ignore_eos=True),
                                      conversation_id=cid)
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


def test_chunk_hashes_chain_over_the_prefix() -> None:
    a = chunk_hashes([1, 2, 3, 4, 5, 6], 4, 2)
    b = chunk_hashes([9, 2, 3, 4, 5, 6], 4, 2)
    assert a[0] != b[0] and a[1] != b[1]  # the second chunk's hash covers the first's tokens
    assert chunk_hashes([1, 2, 3, 4, 5, 6, 7], 4, 2)[0] == a[0]
    assert chunk_hashes([1, 2, 3, 4, 5, 6, 7], 4, 2)[1] != a[1]  # partial: what there is


def test_full_index_evicts_lowest_key_and_refuses_lower() -> None:
    index = DiskIndex(2, C)
    for i, k in enumerate((5.0, 7.0)):
        assert index.add(DiskEntry("x", i, C, "h", key=(1, 0.0, (k, 0.0, "", 0.0))))
    assert not index.add(DiskEntry("y", 0, C, "h", key=(1, 0.0, (1.0, 0.0, "", 0.0))))
    assert index.add(DiskEntry("y", 0, C, "h", key=(1, 0.0, (6.0, 0.0, "", 0.0))))
    assert index.get("x", 0) is None and index.get("x", 1) is not None
    assert index.take_plan().deletes == [DiskEntry("x", 0, C, "h", found_key(0.0)).name]
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
                              conversation_id=cid)
        world.run_all()
    on_disk = sorted(world.disk.index.entries.get("a", {}))
    assert len(on_disk) >= 3, on_disk  # several of "a"'s chunks went to disk
    tokens = sum(e.tokens for e in world.disk.index.of("a"))
    before = world.eng.cache.stats.disk_hit_tokens
    world.eng.add_request("a4", [5, 6, 7, 8], SamplingParams(max_tokens=2, ignore_eos=True),
                          conversation_id="a")
    world.run_all()
    st_ = world.eng.cache.stats
    world.check()
    assert sorted(i for c, i in world.disk.reads if c == "a") == on_disk  # the turn read them
    # every copy read came back, as many as the CPU tier's blocks take (each restore is a
    # read into a CPU block); the old charge would have let one chunk back (C tokens)
    assert st_.disk_hit_tokens - before == min(tokens, CPU * C) > 2 * C
    assert world.ex.checked > 0
