"""Eviction of shared blocks: a block several idle chunks hold leaves a tier as a whole, when
the retention order says so for the block.

A registered block that two chunks or more hold (a shared system prompt, ``refs > 1``) is no
candidate of the eviction index (:mod:`pensieve.core.eviction_index`): evicting it for one
sharer frees nothing. Its key is its sharers' together, ``EvictionPolicy.combine`` of their
keys: for the retention value the *sum* (freeing it costs every sharer its chunk), for the LRU
orders the most recent sharer's. :class:`SharedOrder` ranks, per tier, the shared blocks that
only idle conversations hold by that key, and an urgent eviction pass takes whichever is lower,
the index's lowest chunk or the lowest shared block (:meth:`SharedOrder.top`). A block goes
whole: every holder lets it go, lowest key first, the last moving it (to the CPU tier, or
dropped; from the CPU tier, to disk or dropped) as a private chunk would
(``KVStore._leave_gpu`` through ``evict_chunk``, ``KVStore.drop_cpu_victim``). Background
passes (ahead-of-time swap-outs) never take shared blocks: moving one makes an urgent copy.

A block no running turn reads, nor one being admitted: every holder idle (a running holder
pins it), and, in the CPU tier, no planned swap-in reading it. The ranking is built once per
eviction time ``now`` (one pass over the conversations' chunks, only when the tier has shared
blocks and an urgent pass asks), its keys exact at ``now``; within that time a
block whose holders changed since (a turn admitted, a chunk gone) is passed over, and blocks
shared since wait for the next eviction time.

Fallback (:func:`lowest_shared`): registered blocks out of the
index whose sharers have gone since (one reference left, until their conversation is indexed
again) leave once an urgent pass finds no candidate left, by the same combined key.
"""

from __future__ import annotations

import heapq
import math

from pensieve.core.block_map import BlockMap
from pensieve.core.conversation import Conversation, Tier
from pensieve.core.eviction import EvictionKey
from pensieve.core.eviction_index import EvictionIndex

Holders = list[tuple[EvictionKey, Conversation, int]]
"""A block's holders, ``(key now, conversation, chunk index)``, lowest key first."""


def _holders(conversations: dict[str, Conversation], blocks: BlockMap, tier: Tier,
             min_refs: int) -> dict[int, list[tuple[Conversation, int]]]:
    """Registered blocks of ``tier`` with ``min_refs`` references or more that only idle
    conversations hold: block -> its holders. With ``min_refs`` 2 (the ranking), no CPU block
    a planned swap-in reads either."""
    gpu = tier is Tier.GPU
    at = blocks.gpu.at if gpu else blocks.cpu.at
    refs = blocks.gpu.refs_of if gpu else blocks.cpu.refs_of
    holders: dict[int, list[tuple[Conversation, int]]] = {}
    busy: set[int] = set() if gpu or min_refs < 2 else set(blocks.step_reads)
    for conv in conversations.values():
        for i, ch in enumerate(conv.chunks):
            if ch.tier is tier and at[ch.block] >= 0:
                if conv.running:
                    busy.add(ch.block)
                else:
                    holders.setdefault(ch.block, []).append((conv, i))
    return {b: h for b, h in holders.items()
            if b not in busy and len(h) == refs(b) >= min_refs
            and not (gpu and blocks.gpu.is_pinned(b))}


def _ranked(index: EvictionIndex, hs: list[tuple[Conversation, int]]
            ) -> tuple[EvictionKey, Holders]:
    keyed = sorted(((index.key_now(conv, i), conv, i) for conv, i in hs), key=lambda k: k[0])
    return index.policy.combine([k for k, _, _ in keyed]), keyed


class SharedOrder:
    """One tier's shared blocks held only by idle conversations, lowest combined key first
    (module docstring)."""

    def __init__(self, index: EvictionIndex, blocks: BlockMap, tier: Tier) -> None:
        self.index, self.blocks, self.tier = index, blocks, tier
        self.shared = blocks.gpu.shared if tier is Tier.GPU else blocks.cpu.shared
        self.now = -math.inf
        """The eviction time the ranking was built at."""
        self.heap: list[tuple[float, EvictionKey, int]] = []
        """(key[0], key, block)."""
        self.holders: dict[int, Holders] = {}
        self.builds = 0
        """Rankings built (passes over the conversations)."""
        self.taken = 0
        """Blocks that left the tier whole by this order."""

    @staticmethod
    def pair(index: EvictionIndex, blocks: BlockMap | None, cpu: bool
             ) -> tuple[SharedOrder | None, SharedOrder | None]:
        """The GPU tier's order and the CPU tier's (with ``cpu``: shared there too); None:
        no sharing (``blocks`` None)."""
        if blocks is None:
            return None, None
        return (SharedOrder(index, blocks, Tier.GPU),
                SharedOrder(index, blocks, Tier.CPU) if cpu else None)

    def top(self) -> tuple[EvictionKey, int, Holders] | None:
        """The shared block of lowest combined key at the index's ``now`` (its key, the block,
        its holders lowest key first), or None: none, or no shared block in the tier."""
        shared, gpu = self.shared, self.tier is Tier.GPU
        if not shared:
            return None
        now = self.index.now
        if now != self.now:
            if gpu and self.blocks.gpu.num_pinned >= len(shared) and all(
                    map(self.blocks.gpu.is_pinned, shared)):
                return None  # every one read by a running turn (a system prompt, busy)
            self._build(now)
        heap = self.heap
        refs = self.blocks.gpu.refs_of if gpu else self.blocks.cpu.refs_of
        while heap:
            _, key, b = heap[0]
            hs = self.holders[b]
            if len(hs) == refs(b) and all(
                    not conv.running and i < len(conv.chunks) and conv.chunks[i].tier is
                    self.tier and conv.chunks[i].block == b for _, conv, i in hs) \
                    and not (gpu and self.blocks.gpu.is_pinned(b)) \
                    and (gpu or b not in self.blocks.step_reads):
                return key, b, hs
            self.pop()  # its holders changed at this time: passed over until the next
        return None

    def pop(self) -> None:
        """The top block is passed over (its holders changed at this time)."""
        _, _, b = heapq.heappop(self.heap)
        del self.holders[b]

    def take(self) -> Holders:
        """The top block leaves the tier whole: its holders, lowest key first, for the caller
        to move or drop (the last one frees it)."""
        hs = self.holders[self.heap[0][2]]
        self.pop()
        self.taken += 1
        return hs

    def _build(self, now: float) -> None:
        self.now = now
        self.builds += 1
        heap: list[tuple[float, EvictionKey, int]] = []
        self.holders = {}
        for b, hs in _holders(self.index.conversations, self.blocks, self.tier, 2).items():
            key, keyed = _ranked(self.index, hs)
            self.holders[b] = keyed
            heap.append((key[0], key, b))
        heapq.heapify(heap)
        self.heap = heap


def lowest_shared(index: EvictionIndex, blocks: BlockMap, tier: Tier
                  ) -> tuple[EvictionKey, int, Holders] | None:
    """The fallback: the registered block of ``tier`` of lowest combined key that only idle
    conversations hold, whatever its references (its key, the block, its holders lowest key
    first: the last one's move or drop frees it); None: none."""
    best: tuple[EvictionKey, int, Holders] | None = None
    for b, hs in _holders(index.conversations, blocks, tier, 1).items():
        key, keyed = _ranked(index, hs)
        if best is None or key < best[0]:
            best = (key, b, keyed)
    return best
