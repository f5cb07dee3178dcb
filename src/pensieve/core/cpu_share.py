"""Shared prefixes in the CPU tier: equal full chunks held once there too, reference-counted.

The GPU tier's registry (:class:`~pensieve.core.prefix_share.PrefixShare`) has a twin over
CPU blocks, :class:`CpuShare`, keyed by the same chained hashes:

- Registration. A registered GPU block whose last reference leaves for the CPU registers
  the CPU block it goes to under its hash; if that hash is registered on the CPU already,
  the chunk takes a reference to that CPU block instead (no copy, the GPU block is freed).
  The eviction fallback (:mod:`pensieve.core.shared_eviction`, idle holders only) moves a
  shared GPU block *once*: its first holder copies it to a new CPU block (an urgent copy; the
  GPU block stays, the other holders still hold it) and registers it, the others take
  references to it, and the last one frees the GPU block. A suspension still lets a shared
  chunk go (it re-shares from the GPU, or from the CPU, at its next admission).
- Admission (:func:`pensieve.core.share_admission.find_shared`). A dropped full chunk, or a
  leading full chunk of a conversation without KV, whose hash is not registered on the GPU
  but is on the CPU takes a reference to that CPU block; the turn swaps it in as any CPU
  chunk into a GPU block of its own (``cpu_hit_tokens``; ``cpu_shared_tokens`` of them),
  which its turn's end registers on the GPU. A CPU block a background copy of this step
  writes is not taken (the step's copies read before that one writes).
- Reads. A swap-in reading a registered CPU block drops the chunk's reference but the read
  is counted (``reads``) until the pools reclaim it (``TierPools.begin_step``): a block no
  chunk holds any more while a read is pending (``orphans``) is freed only then, so a block a
  planned swap-in reads is never freed, moved or overwritten.
- Leaving the CPU (an eviction drop, a truncation, recompute instead of swap-in) drops one
  reference; only the last frees the block (to disk first, when there is one), unregisters
  it and cancels this step's copy into it.
- Eviction. As on the GPU, a CPU chunk whose block others hold too is no CPU eviction
  candidate (:meth:`EvictionIndex.first`); once the CPU index is empty and the tier full,
  :func:`drop_shared_cpu` drops the block of lowest last-sharer key, all its holders at once.

Invariants (:func:`check_cpu`): each CPU block's holders equal its references (1 when
unregistered); the reclaim lists hold every pending read of a registered block as often as
``reads`` counts it, and private swapped-in blocks once, held by no chunk; orphans are read
and held by none.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

from pensieve.core.block_pool import BlockPool
from pensieve.core.conversation import Conversation, Tier
from pensieve.core.eviction import EvictionKey
from pensieve.core.eviction_index import EvictionIndex
from pensieve.core.prefix_share import PrefixShare
from pensieve.core.stats import CacheStats


class _Plan(Protocol):
    swap_out_first: dict[int, int]
    swap_out: dict[int, int]


class TierPoolsView(Protocol):
    """What this module's functions and the pools' audit read of
    :class:`~pensieve.core.tier_pools.TierPools`, which imports them (a protocol, so that
    neither imports it back)."""

    chunk_size: int
    gpu: BlockPool
    cpu: BlockPool | None
    share: PrefixShare | None
    cpu_share: CpuShare | None
    index: EvictionIndex
    stats: CacheStats
    reads: SwapInReads

    @property
    def plan(self) -> _Plan: ...

    def take_cpu_block(self, key: EvictionKey | None, settle: bool = False) -> int: ...

    def drop_cpu_chunk(self, conv: Conversation, i: int) -> None: ...

    def copy_out_now(self, gpu_block: int, cpu_block: int, tokens: int) -> None: ...

    def drop_cpu_victim(self, conv: Conversation, i: int) -> None: ...

    def pending_reclaim_gpu(self) -> int: ...


class CpuShare(PrefixShare):
    """The CPU tier's registered blocks (``refs`` and ``hash_of`` indexed by CPU block;
    ``pins`` unused: no running conversation holds a CPU chunk), and the pending reads."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.reads: dict[int, int] = {}
        """Registered CPU blocks read by planned swap-ins not yet reclaimed -> how many."""
        self.orphans: set[int] = set()
        """Blocks of ``reads`` no chunk holds any more: freed when their last read ends."""
        self.step_reads: set[int] = set()
        """Registered blocks this step's swap-ins read: a step's plan reads a CPU block once
        (the runner's copy batches cut disjoint runs of CPU blocks), so a chunk of one of
        these is recomputed instead (:func:`drop_read_twice`) and admission takes none."""

    def register(self, block: int, h: bytes) -> None:
        """The chunk holding the private CPU ``block`` of hash ``h`` registers it."""
        self.by_hash[h] = block
        self.hash_of[block] = h
        self.refs[block] = 1
        self.num_refs += 1

    def read(self, block: int) -> None:
        """A planned swap-in reads ``block`` (registered) for a chunk that leaves the CPU."""
        reads = self.reads
        reads[block] = reads.get(block, 0) + 1
        self.step_reads.add(block)
        n = self.refs[block]
        self.refs[block] = n - 1
        self.num_refs -= 1
        if n == 1:  # its last holder: unregistered, freed once read
            del self.by_hash[self.hash_of[block]]
            self.hash_of[block] = b""
            self.orphans.add(block)

    def end_reads(self, pool: BlockPool, blocks: list[int]) -> None:
        """The swap-ins reading ``blocks`` are done: free the private ones, and the orphans
        whose last read this was."""
        reads = self.reads
        if not reads:
            pool.free(blocks)
            return
        for b in blocks:
            n = reads.get(b)
            if n is None:
                pool.free_one(b)
            elif n > 1:
                reads[b] = n - 1
            else:
                del reads[b]
                if b in self.orphans:
                    self.orphans.remove(b)
                    pool.free_one(b)


class SwapInReads:
    """The CPU blocks planned swap-ins read, freed once the runner has read them: ``now``
    (this and the previous step's swap-ins: at the next step's start) and ``ahead`` (this
    step's ``swap_in_ahead``: they join ``now`` then, so are freed one step later). A block
    of a registered CPU chunk is freed only once no chunk holds it and its reads are done
    (:meth:`CpuShare.end_reads`)."""

    def __init__(self, pool: BlockPool | None, share: CpuShare | None) -> None:
        self.pool, self.share = pool, share
        self.now: list[int] = []
        self.ahead: list[int] = []

    def begin_step(self) -> None:
        """Free the blocks of ``now``; ``ahead`` becomes ``now``."""
        if self.share is not None:
            self.share.step_reads.clear()
        if self.pool is not None:
            if self.share is not None:
                self.share.end_reads(self.pool, self.now)
            else:
                self.pool.free(self.now)
        self.now, self.ahead = self.ahead, []

    def add(self, blocks: list[int]) -> None:
        """This step's swap-ins read ``blocks`` (freed at the next step's start)."""
        self.now.extend(blocks)

    def move_ahead(self, blocks: list[int]) -> None:
        """The swap-ins reading ``blocks`` move to this step's ``swap_in_ahead``."""
        if self.share is None or not self.share.reads:  # each block once in ``now``
            moved = set(blocks)
            self.now = [b for b in self.now if b not in moved]
        else:
            self.now = without(self.now, blocks)
        self.ahead.extend(blocks)


def lookup_cpu(pools: TierPoolsView, h: bytes) -> int:
    """The registered CPU block of hash ``h`` a chunk may take a reference to now, or -1 (none,
    or one a background copy of this step still writes)."""
    cs = pools.cpu_share
    if cs is None:
        return -1
    b = cs.by_hash.get(h, -1)
    return -1 if b in pools.plan.swap_out or b in cs.step_reads else b


def drop_read_twice(pools: TierPoolsView, conv: Conversation) -> int:
    """The CPU chunks of ``conv`` (being admitted) whose block another swap-in of this step
    reads already are dropped, to be recomputed (:attr:`CpuShare.step_reads`); returns
    their tokens."""
    cs = pools.cpu_share
    if cs is None or not cs.step_reads:
        return 0
    tokens = 0
    for i, ch in enumerate(conv.chunks):
        if ch.tier is Tier.CPU and ch.block in cs.step_reads:
            tokens += conv.chunk_tokens(i, pools.chunk_size)
            pools.drop_cpu_chunk(conv, i)
    return tokens


def release_cpu(pools: TierPoolsView, block: int) -> bool:
    """A chunk lets its CPU ``block`` go: False if other chunks still hold it (or a planned
    swap-in still reads it: then it is freed at reclaim); True if the caller frees it."""
    cs = pools.cpu_share
    if cs is None or not cs.refs[block]:
        return True
    if not cs.unref(block):
        return False
    if block in cs.reads:
        cs.orphans.add(block)
        return False
    return True


def to_cpu_copy(pools: TierPoolsView, conv: Conversation, i: int, h: bytes,
                key: EvictionKey | None) -> bool:
    """GPU chunk ``i`` of an idle ``conv``, of hash ``h``, whose block stays on the GPU (other
    chunks hold it, or the caller frees it) takes a reference to the block's CPU copy, made
    now (an urgent copy, registered) if there is none; False if it cannot (no CPU block, or
    the copy is written in the background this step). The caller indexes it."""
    cs = pools.cpu_share
    if cs is None:
        return False
    ch = conv.chunks[i]
    cb = lookup_cpu(pools, h)
    if cb >= 0:
        cs.ref(cb)
    elif h in cs.by_hash:  # its copy is written in the background this step
        return False
    else:
        cb = pools.take_cpu_block(pools.index.key_now(conv, i) if key is None else key)
        if cb < 0:
            return False
        # urgent: the GPU block stays held (not freed)
        pools.copy_out_now(ch.block, cb, conv.chunk_tokens(i, pools.chunk_size))
        cs.register(cb, h)
    ch.tier, ch.block = Tier.CPU, cb
    return True


def drop_shared_cpu(pools: TierPoolsView, key: EvictionKey | None) -> bool:
    """The CPU tier's fallback, once its index has no candidate left (every CPU chunk holds
    a registered block out of the index, as on the GPU: :mod:`pensieve.core.shared_eviction`):
    drop the registered CPU block of lowest last-sharer key that only idle conversations
    hold, every holder letting it go (the last spills it to disk, when there is a disk tier),
    unless ``key`` (None: any) is lower. True if one went. Cost: one pass over the
    conversations' chunks, only when the CPU index is empty and the tier full."""
    cs, idx = pools.cpu_share, pools.index
    assert cs is not None
    holders: dict[int, list[tuple[Conversation, int]]] = {}
    running: set[int] = set()
    for conv in idx.conversations.values():
        for i, ch in enumerate(conv.chunks):
            if ch.tier is Tier.CPU and cs.refs[ch.block]:
                holders.setdefault(ch.block, []).append((conv, i))
                if conv.running:  # references taken by a turn being admitted
                    running.add(ch.block)
    best: tuple[EvictionKey, list[tuple[EvictionKey, Conversation, int]]] | None = None
    for b, hs in holders.items():
        if b in running:
            continue
        keyed = sorted(((idx.key_now(conv, i), conv, i) for conv, i in hs), key=lambda k: k[0])
        if best is None or keyed[-1][0] < best[0]:
            best = (keyed[-1][0], keyed)
    if best is None or (key is not None and key < best[0]):
        return False
    for _, conv, i in best[1]:
        pools.drop_cpu_victim(conv, i)
        idx.reindex_cpu(conv)
    return True


def without(reclaim: list[int], moved: list[int]) -> list[int]:
    """``reclaim`` less one entry per block of ``moved`` (a shared block read by several
    swap-ins has one entry per read), from its end."""
    drop = Counter(moved)
    keep: list[int] = []
    for b in reversed(reclaim):
        if drop[b]:
            drop[b] -= 1
        else:
            keep.append(b)
    return keep[::-1]


def check_cpu(pools: TierPoolsView, reclaim: list[int]) -> None:
    """Raise AssertionError unless the CPU pool, the chunks holding its blocks, the registry
    and the pending reads agree (module docstring)."""
    cs, cpu = pools.cpu_share, pools.cpu
    assert cs is not None and cpu is not None
    holders: Counter[int] = Counter()
    for conv in pools.index.conversations.values():
        for ch in conv.chunks:
            if ch.tier is Tier.CPU:
                holders[ch.block] += 1
    for b, n in holders.items():
        assert not cpu.is_free(b), f"CPU block {b} held and free"
        assert n == (cs.refs[b] or 1), f"CPU block {b}: {n} holders, refs {cs.refs[b]}"
    cs.check(dict(holders), {})
    pending = Counter(reclaim)
    for b, n in pending.items():
        assert not cpu.is_free(b), f"CPU block {b} read and free"
        if b in cs.reads:
            assert cs.reads[b] == n, f"CPU block {b}: reads {cs.reads[b]}, reclaims {n}"
        else:
            assert n == 1 and b not in holders, f"CPU block {b} reclaim clash"
    assert all(b in pending for b in cs.reads), "a read with no reclaim"
    for b in cs.orphans:
        assert b in cs.reads and b not in holders and not cs.refs[b], f"orphan {b}"
    total = len(set(holders) | set(pending)) + cpu.num_free_blocks
    assert total == cpu.num_blocks, f"CPU: {total} accounted of {cpu.num_blocks}"
