"""Eviction of shared GPU blocks: the fallback once the eviction index has no candidate left.

A GPU block that several chunks hold (a shared system prompt, ``refs > 1``) is worth what all
of its sharers would lose: evicting it for one sharer frees nothing, and freeing it makes every
sharer (and every new conversation that would have taken it) compute the prefix again. So
such chunks are no eviction candidates (:mod:`pensieve.core.eviction_index`): every chunk an
idle conversation holds alone goes first, whatever its key. Chunks left out of the index that
way (and those whose sharers have gone since, refs back to 1, until their conversation is
indexed again) leave only here, when an urgent eviction pass (an admission short of blocks)
still needs blocks and the index is empty, so that eviction can always make room; background
passes (ahead-of-time swap-outs) never take them:

- a block goes only if idle conversations hold all of its references (no running turn reads
  it, nor one being admitted: it holds a reference already);
- blocks go in the order of their *last* sharer's key (the highest of its holders' keys: the
  block stays while any sharer would keep it), lowest first; each holder lets it go in turn,
  the one of the highest key last, which moves the block to the CPU tier or drops it as a
  private chunk would (``KVStore._leave_gpu``, through ``evict_chunk``).

The CPU tier has the same fallback (:func:`shared_cpu_victims`): once its index is empty and
the tier full, the registered CPU block of lowest last-sharer key is dropped, all its holders
at once.

Cost: one pass over the idle conversations' chunks per call, only when an urgent pass finds
the index empty.
"""

from __future__ import annotations

from collections.abc import Callable

from pensieve.core.block_map import BlockMap
from pensieve.core.conversation import Conversation, Tier
from pensieve.core.eviction import EvictionKey
from pensieve.core.eviction_index import EvictionIndex

EvictChunk = Callable[[Conversation, int, EvictionKey], object]
"""Chunk ``i`` of an idle conversation (of key ``key`` now) leaves the GPU: the store's
``KVStore._evict_chunk`` (a shared block's holder drops its reference, the last moves it)."""


def shared_holders(conversations: dict[str, Conversation], blocks: BlockMap
                   ) -> dict[int, list[tuple[Conversation, int]]]:
    """Registered GPU blocks that only idle conversations hold: block -> ``(conversation,
    chunk index)`` of every holder."""
    holders: dict[int, list[tuple[Conversation, int]]] = {}
    at = blocks.at_gpu
    for conv in conversations.values():
        if conv.running:
            continue
        for i, ch in enumerate(conv.chunks):
            if ch.tier is Tier.GPU and at[ch.block] >= 0:
                holders.setdefault(ch.block, []).append((conv, i))
    return {b: h for b, h in holders.items() if len(h) == blocks.gpu_refs_of(b)}


def shared_cpu_victims(index: EvictionIndex, blocks: BlockMap, key: EvictionKey | None
                       ) -> list[tuple[Conversation, int]]:
    """The holders of the registered CPU block of lowest last-sharer key that only idle
    conversations hold, lowest key first (the last one's drop frees the block), unless ``key``
    (None: any) is lower than that block's key; empty: none."""
    holders: dict[int, list[tuple[Conversation, int]]] = {}
    running: set[int] = set()
    at = blocks.at_cpu
    for conv in index.conversations.values():
        for i, ch in enumerate(conv.chunks):
            if ch.tier is Tier.CPU and at[ch.block] >= 0:
                holders.setdefault(ch.block, []).append((conv, i))
                if conv.running:  # references taken by a turn being admitted
                    running.add(ch.block)
    best: tuple[EvictionKey, list[tuple[EvictionKey, Conversation, int]]] | None = None
    for b, hs in holders.items():
        if b in running:
            continue
        keyed = sorted(((index.key_now(conv, i), conv, i) for conv, i in hs),
                       key=lambda k: k[0])
        if best is None or keyed[-1][0] < best[0]:
            best = (keyed[-1][0], keyed)
    if best is None or (key is not None and key < best[0]):
        return []
    return [(conv, i) for _, conv, i in best[1]]


def evict_shared(index: EvictionIndex, blocks: BlockMap, n: int,
                 evict_chunk: EvictChunk) -> int:
    """Free up to ``n`` registered GPU blocks held only by idle conversations, in the order of
    their last sharer's key at the index's ``now`` (module docstring), each holder through
    ``evict_chunk``, the one of the highest key last; returns how many blocks left the GPU."""
    ranked: list[tuple[EvictionKey, list[tuple[EvictionKey, Conversation, int]]]] = []
    for holders in shared_holders(index.conversations, blocks).values():
        keyed = sorted(((index.key_now(conv, i), conv, i) for conv, i in holders),
                       key=lambda k: k[0])
        ranked.append((keyed[-1][0], keyed))
    ranked.sort(key=lambda r: r[0])
    for _, keyed in ranked[:n]:
        for key, conv, i in keyed:
            evict_chunk(conv, i, key)
    return min(n, len(ranked))
