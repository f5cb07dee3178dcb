"""The eviction index: per tier, which idle chunk goes first, in the policy's exact order.

Eviction index: cost of a step is what it changes, not what the cache holds. Per tier (GPU,
CPU) the cache keeps the *eviction candidates*: each idle conversation with a chunk in that
tier, with its first such chunk in the policy's chunk order (leading chunks first; the tail
first for ``tail_first`` policies). Within a conversation keys only grow in that order (when
``Cost`` does not decrease with context), so the lowest key of the tier is the lowest of the
candidates. Candidates sit in a heap with lazy invalidation (each entry carries a sequence
number; the live one is recorded per conversation). A conversation's entry changes only when
it is evicted from, admitted (it leaves the index), ends, suspends or is aborted (it is
indexed again from scratch, one pass over its chunks), gets retention hints (or its tenant
crosses its ``tenant_kv_share``: :mod:`pensieve.core.tenant_share`), or a chunk of it
enters the CPU tier ahead of its CPU cursor. Pinned (running) GPU blocks are a running count.

Shared blocks (:mod:`pensieve.core.block_map`). A GPU chunk whose block other chunks hold too
(``BlockMap.gpu.shared``) is no candidate: evicting it would free nothing (the sharer only
drops its reference). The block is one unit of the retention order, keyed by its sharers
together (:class:`pensieve.core.shared_eviction.SharedOrder`), which an urgent pass compares
with this index's lowest chunk. :meth:`EvictionIndex.first` skips such chunks, so a
conversation's GPU candidate is its first chunk in the policy's order that it holds alone. A
chunk that becomes shared after it was indexed is skipped when it surfaces
(``KVStore.evict_gpu``); one skipped while shared whose sharers have gone since stays out until
its conversation is indexed again, and leaves by the fallback once an urgent pass finds no
candidate left (:func:`pensieve.core.shared_eviction.lowest_shared`). CPU chunks likewise
(``BlockMap.cpu.shared``). Invariant: every GPU (CPU)
chunk of an idle conversation before its GPU (CPU) candidate (all of them, without one) holds a
registered block.

Time-dependent keys (``key_refresh_s``, ``R``). The ``pensieve`` key ``priority * Cost(l) /
idle time`` depends on ``now``, so conversations' order changes over time and no static
heap holds it. It only falls while a conversation stays idle, though, so a key evaluated at a
later time is a lower bound of the key now. The index keeps every entry keyed at one time
``t_e >= now`` (lower bounds); when an eviction at ``now`` finds a lower bound at the top of the
heap, it evaluates that entry at ``now`` and puts it back, until the top is exact: no other
chunk can then have a lower key, so the eviction order is the policy's exact order at ``now``.
Entries evaluated at ``now`` are keyed at ``t_e`` again when time moves on; once ``now`` passes
``t_e``, the whole index is re-keyed (``O(candidates)``) at ``t_e = now + R``. ``R`` trades
that re-key (at most once per ``R`` seconds) against extra evaluations within an eviction:
entries whose bound at ``t_e`` is far below their key now (conversations idle for less than a
few ``R``) surface and are evaluated once per eviction time. ``R = 0`` re-keys at every new
``now``. Keys of ``lru`` and ``prefix-lru`` do not depend on ``now`` and are used as they are.
A policy whose time-dependent key could grow while a conversation stays idle would break the
lower bounds (``EvictionPolicy.time_dependent``); one that says so (``key_may_grow``: the
simulator's ``oracle``) gets ``R = 0``, every candidate keyed exactly at each new ``now``.

:class:`EvictionIndex` holds the index of both tiers and the key times. It changes no chunk:
:class:`~pensieve.core.kv_store.KVStore` holds it to pick victims as it moves chunks, and
:class:`~pensieve.core.tiered_cache.TieredKVCache` holds both and tells the index when a turn
starts or ends.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator
from functools import partial

from pensieve.core.block_map import BlockMap
from pensieve.core.conversation import Conversation, Tier
from pensieve.core.eviction import ChunkCost, EvictionKey, EvictionPolicy

Victim = tuple[EvictionKey, Conversation, int]
"""(key, conversation, chunk index) of an eviction candidate."""


class _Memo(dict[int, float]):
    """Values of ``fn`` by argument, computed on first use."""

    __slots__ = ("fn",)

    def __init__(self, fn: ChunkCost) -> None:
        super().__init__()
        self.fn = fn

    def __missing__(self, key: int) -> float:
        v = self[key] = self.fn(key)
        return v


class TierIndex:
    """Eviction candidates of one tier: per idle conversation with a chunk in the tier, the
    index of its first such chunk in the policy's order, that chunk's key and the time the key
    was evaluated at; a heap of ``(key[0], key, seq, conversation, chunk index)`` whose entry
    is live iff its ``seq`` is the one recorded for the conversation (older entries are
    skipped when they surface). The key's first element leads the entry so that a sift
    compares two floats, not two nested tuples, when they differ (the order is the same as
    ``(key, seq)``'s)."""

    __slots__ = ("live", "heap", "_seq")

    def __init__(self) -> None:
        self.live: dict[Conversation, tuple[int, int, EvictionKey, float]] = {}
        """conversation -> (chunk index, seq, key, evaluation time) of its live entry."""
        self.heap: list[tuple[float, EvictionKey, int, Conversation, int]] = []
        self._seq = 0

    def set(self, conv: Conversation, index: int, key: EvictionKey, t: float) -> None:
        self._seq += 1
        self.live[conv] = (index, self._seq, key, t)
        heapq.heappush(self.heap, (key[0], key, self._seq, conv, index))
        if len(self.heap) > 2 * len(self.live) + 64:
            self._rebuild(self.live)

    def discard(self, conv: Conversation) -> None:
        self.live.pop(conv, None)

    def replace_top(self, conv: Conversation, index: int, key: EvictionKey, t: float) -> None:
        """Like :meth:`set`, when ``conv``'s live entry is the heap's top (:meth:`peek` just
        returned it): one sift."""
        self._seq += 1
        self.live[conv] = (index, self._seq, key, t)
        heapq.heapreplace(self.heap, (key[0], key, self._seq, conv, index))

    def pop_top(self, conv: Conversation) -> None:
        """Like :meth:`discard`, when ``conv``'s live entry is the heap's top."""
        del self.live[conv]
        heapq.heappop(self.heap)

    def peek(self) -> Victim | None:
        heap, live = self.heap, self.live
        while heap:
            _, key, seq, conv, index = heap[0]
            entry = live.get(conv)
            if entry is not None and entry[1] == seq:
                return key, conv, index
            heapq.heappop(heap)
        return None

    def lowest(self) -> Iterator[Victim]:
        """The live candidates in key order (as last keyed: lower bounds while time passes),
        lowest first, without changing the heap: a walk of its tree from the root, a
        frontier heap of the items seen; O(log k) per candidate taken."""
        heap, live = self.heap, self.live
        if not heap:
            return
        frontier = [(heap[0], 0)]
        n = len(heap)
        while frontier:
            item, at = heapq.heappop(frontier)
            _, key, seq, conv, index = item
            entry = live.get(conv)
            if entry is not None and entry[1] == seq:
                yield key, conv, index
            for child in (2 * at + 1, 2 * at + 2):
                if child < n:
                    heapq.heappush(frontier, (heap[child], child))

    def rekey(self, key_of: Callable[[Conversation, int], EvictionKey], t: float) -> None:
        """Every candidate's key anew (same chunk), ``key_of(conv, chunk)``, evaluated at
        ``t``: one pass building the entries and the heap."""
        live: dict[Conversation, tuple[int, int, EvictionKey, float]] = {}
        heap: list[tuple[float, EvictionKey, int, Conversation, int]] = []
        seq = self._seq
        for conv, (i, _, _, _) in self.live.items():
            seq += 1
            key = key_of(conv, i)
            live[conv] = (i, seq, key, t)
            heap.append((key[0], key, seq, conv, i))
        heapq.heapify(heap)
        self.live, self.heap, self._seq = live, heap, seq

    def _rebuild(self, live: dict[Conversation, tuple[int, int, EvictionKey, float]]) -> None:
        self.live = {}
        self.heap = []
        for conv, (index, _, key, t) in live.items():
            self._seq += 1
            self.live[conv] = (index, self._seq, key, t)
            self.heap.append((key[0], key, self._seq, conv, index))
        heapq.heapify(self.heap)


class EvictionIndex:
    """The eviction candidates of both tiers over the conversations, and the times their keys
    are evaluated at.

    The owner of the chunks (:class:`~pensieve.core.kv_store.KVStore`, and the cache for
    turns) calls it whenever a candidate may have changed (the module docstring lists when);
    during an eviction at ``now``, :meth:`peek_victim` gives each tier's lowest chunk."""

    exact_max = 1024
    """Entries keyed at one ``now`` kept listed before they are made bounds again anyway."""

    def __init__(self, conversations: dict[str, Conversation], chunk_size: int,
                 policy: EvictionPolicy, chunk_cost: ChunkCost, key_refresh_s: float,
                 blocks: BlockMap | None = None) -> None:
        """``conversations``: the cache's (shared, not copied; read by :meth:`check`).
        ``blocks``: the store's block map when prefixes are shared (read only: chunks whose
        slot others hold too are no candidates, module docstring)."""
        if not key_refresh_s >= 0.0:
            raise ValueError(f"key_refresh_s must be >= 0, got {key_refresh_s}")
        self.conversations = conversations
        self.chunk_size = chunk_size
        self.policy = policy
        self.chunk_cost = chunk_cost
        self.key_refresh_s = 0.0 if policy.key_may_grow else key_refresh_s
        self.gpu = TierIndex()
        """Candidates of the GPU tier."""
        self.cpu = TierIndex()
        """Candidates of the CPU tier."""
        self.t_eval = -math.inf
        """``t_e``: the index's keys are evaluated at ``t_e`` (lower bounds while ``now <=
        t_e``), or exactly at :attr:`now` for the entries in :attr:`keyed_now` (module
        docstring)."""
        self.now = -math.inf
        """``now`` of the last eviction (and of the one under way)."""
        self.keyed_now: list[tuple[TierIndex, Conversation]] = []
        """Entries keyed at ``now`` (not ``t_e``): keyed again at ``t_e`` when time moves.
        Whoever keys an entry at ``now`` lists it here (time-dependent keys only)."""
        self.time_dependent = policy.time_dependent
        self.step = -1 if policy.tail_first else 1
        """+1: a conversation's chunks go leading first; -1: tail first."""
        self.cost: Callable[[int], float] = _Memo(chunk_cost).__getitem__
        """``chunk_cost``, memoised (a pure function of the context length): a dictionary's
        own lookup, which the eviction calls once per chunk it keys."""
        self.blocks = blocks
        """The block map (None: no sharing); read, never written."""
        self.shared_gpu: set[int] = blocks.gpu.shared if blocks is not None else set()
        """GPU slots that two chunks or more hold (the block map's set; empty: no sharing)."""
        self.shared_cpu: set[int] = blocks.cpu.shared if blocks is not None else set()
        """CPU slots likewise."""

    def rekey(self, conv: Conversation) -> None:
        """The inputs of ``conv``'s keys changed: its index entries follow."""
        if not conv.running:
            for index in (self.gpu, self.cpu):
                entry = index.live.get(conv)
                if entry is not None:
                    index.set(conv, entry[0], self.key(conv, entry[0]), self.t_eval)


    def key(self, conv: Conversation, i: int) -> EvictionKey:
        """Chunk ``i``'s key at ``t_e`` (a lower bound of its key at any ``now <= t_e``)."""
        return self.policy.key(conv, i, self.t_eval, self.cost, self.chunk_size)

    def key_now(self, conv: Conversation, i: int) -> EvictionKey:
        """Chunk ``i``'s key now (during an eviction)."""
        return self.policy.key(conv, i, self.now, self.cost, self.chunk_size)

    def refresh(self, now: float) -> None:
        """An eviction starts at ``now``. Keys evaluated at an earlier ``now`` are keyed at
        ``t_e`` again (they would not be lower bounds any more); all keys are re-evaluated at
        ``now + key_refresh_s`` once ``now`` passes ``t_e``."""
        if now == self.now:
            if len(self.keyed_now) > self.exact_max + 2 * len(self.gpu.live):
                self._rebound()  # many evictions at one now: bounds again (still valid)
            return
        self.now = now
        if not self.time_dependent:
            return
        t_e = self.t_eval
        if not t_e - self.key_refresh_s <= now <= t_e:
            t_e = self.t_eval = now + self.key_refresh_s
            key_of = partial(self.policy.key, now=t_e, cost=self.cost,
                             chunk_size=self.chunk_size)
            for index in (self.gpu, self.cpu):
                index.rekey(key_of, t_e)
            self.keyed_now.clear()
        else:
            self._rebound()

    def _rebound(self) -> None:
        """Entries keyed at ``now`` are keyed at ``t_e`` again (lower bounds)."""
        t_e = self.t_eval
        for index, conv in self.keyed_now:
            entry = index.live.get(conv)
            if entry is not None and entry[3] != t_e:
                index.set(conv, entry[0], self.key(conv, entry[0]), t_e)
        self.keyed_now.clear()

    def first(self, conv: Conversation, tier: Tier, start: int) -> int | None:
        """The first chunk in ``tier`` from ``start`` on, in the policy's chunk order (on the
        GPU or CPU with shared prefixes, the first whose block no other chunk shares)."""
        chunks = conv.chunks
        shared = self.shared_gpu if tier is Tier.GPU else self.shared_cpu
        if 0 <= start < len(chunks):  # the common answer first: ``start`` itself
            ch = chunks[start]
            if ch.tier is tier and ch.block not in shared:
                return start
        if shared:
            order = (range(max(start, 0), len(chunks)) if self.step > 0
                     else range(min(start, len(chunks) - 1), -1, -1))
            for i in order:
                ch = chunks[i]
                if ch.tier is tier and ch.block not in shared:
                    return i
            return None
        if self.step > 0:
            for i in range(max(start, 0), len(chunks)):
                if chunks[i].tier is tier:
                    return i
        else:
            for i in range(min(start, len(chunks) - 1), -1, -1):
                if chunks[i].tier is tier:
                    return i
        return None

    def start(self, conv: Conversation) -> int:
        """Where the policy's chunk order starts in ``conv``."""
        return 0 if self.step > 0 else len(conv.chunks) - 1

    def _advance(self, index: TierIndex, tier: Tier, conv: Conversation, start: int) -> None:
        """The conversation's candidate in ``tier`` is its first chunk there from ``start``."""
        i = self.first(conv, tier, start)
        if i is None:
            index.discard(conv)
        else:
            index.set(conv, i, self.key(conv, i), self.t_eval)

    def reindex(self, conv: Conversation) -> None:
        """(Re)index an idle conversation from scratch (its chunks or its key changed)."""
        self._advance(self.gpu, Tier.GPU, conv, self.start(conv))
        self._advance(self.cpu, Tier.CPU, conv, self.start(conv))

    def reindex_cpu(self, conv: Conversation) -> None:
        """(Re)index an idle conversation's CPU candidate from scratch."""
        self._advance(self.cpu, Tier.CPU, conv, self.start(conv))

    def remove(self, conv: Conversation) -> None:
        """``conv`` leaves the index (its turn starts, or it is deleted)."""
        self.gpu.discard(conv)
        self.cpu.discard(conv)

    def entered_cpu(self, conv: Conversation, i: int, key_now: EvictionKey | None = None
                    ) -> None:
        """Chunk ``i`` of an idle conversation just reached the CPU tier: it becomes the
        conversation's CPU candidate if it comes first in the policy's order. ``key_now``: its
        key at :attr:`now` (during an eviction), which the entry then holds; else it is keyed
        at ``t_e``."""
        cpu = self.cpu
        if conv.chunks[i].block in self.shared_cpu:
            return  # shared: no candidate
        entry = cpu.live.get(conv)
        if entry is None or (i - entry[0]) * self.step < 0:
            if key_now is None:
                cpu.set(conv, i, self.key(conv, i), self.t_eval)
            else:
                cpu.set(conv, i, key_now, self.now)
                if self.time_dependent:
                    self.keyed_now.append((cpu, conv))

    def pass_top(self, index: TierIndex, tier: Tier, conv: Conversation, i: int) -> None:
        """Chunk ``i`` of ``conv``, the top of ``index`` (``tier``'s), just left the tier: the
        conversation's next chunk there takes its place, keyed at :attr:`now`."""
        j = self.first(conv, tier, i + self.step)
        if j is None:
            index.pop_top(conv)
        else:
            index.replace_top(conv, j, self.key_now(conv, j), self.now)
            if self.time_dependent:
                self.keyed_now.append((index, conv))

    def peek_victim(self, tier: Tier) -> Victim | None:
        """The idle chunk of lowest key in ``tier`` now (during an eviction at :attr:`now`).

        Entries keyed at ``t_e`` hold lower bounds: while the lowest entry is one, it is keyed
        again at ``now`` (exact) and goes back in the heap; once the lowest is exact, no other
        chunk's key can be lower."""
        index = self.gpu if tier is Tier.GPU else self.cpu
        if not self.time_dependent:
            return index.peek()
        now = self.now
        while (top := index.peek()) is not None:
            _, conv, i = top
            if index.live[conv][3] == now:
                return top
            index.replace_top(conv, i, self.key_now(conv, i), now)
            self.keyed_now.append((index, conv))
        return None

    def check(self) -> None:
        """Raise AssertionError unless both tiers' candidates, keys and heaps equal a full
        recomputation over the conversations."""
        self._check_index(self.gpu, Tier.GPU)
        self._check_index(self.cpu, Tier.CPU)

    def _check_index(self, index: TierIndex, tier: Tier) -> None:
        got = {conv: i for conv, (i, _, _, _) in index.live.items()}
        if self.blocks is not None:
            self._check_shared(got, self.blocks, tier)
        else:
            want: dict[Conversation, int] = {}
            for conv in self.conversations.values():
                i = None if conv.running else self.first(conv, tier, self.start(conv))
                if i is not None:
                    want[conv] = i
            assert got == want, f"{tier} index: {len(got)} candidates, want {len(want)}"
        heap = {seq: (key, conv, i) for _, key, seq, conv, i in index.heap}
        exact = {id(c) for x, c in self.keyed_now if x is index}
        for conv, (i, seq, key, t) in index.live.items():
            cid = conv.conversation_id
            assert self.conversations.get(cid) is conv, cid
            assert key == self.policy.key(conv, i, t, self.cost, self.chunk_size), (
                tier, cid, i, "stale key")
            assert heap.get(seq) == (key, conv, i), (tier, cid, "not in heap")
            if self.time_dependent:  # a lower bound (at t_e), or exact now and listed
                assert t == self.t_eval or (t == self.now and id(conv) in exact), (
                    tier, cid, t, "keyed at neither t_e nor now")

    def _check_shared(self, got: dict[Conversation, int], blocks: BlockMap, tier: Tier
                      ) -> None:
        """The candidates of ``tier`` with shared blocks (module docstring): each idle
        conversation's is a chunk there, and every chunk there before it in the policy's order
        (all of them, without one) holds a registered block; no running conversation has one."""
        for conv in self.conversations.values():
            cid, chunks = conv.conversation_id, conv.chunks
            i = got.get(conv)
            if conv.running:
                assert i is None, (cid, "running conversation indexed")
                continue
            if i is not None:
                assert chunks[i].tier is tier, (cid, i, tier, "candidate not in its tier")
            order = range(len(chunks)) if self.step > 0 else range(len(chunks) - 1, -1, -1)
            for j in order:
                if j == i:
                    break
                ch = chunks[j]
                refs = blocks.gpu.refs_of if tier is Tier.GPU else blocks.cpu.refs_of
                assert ch.tier is not tier or refs(ch.block), (
                    cid, j, tier, "unshared chunk before the candidate")
