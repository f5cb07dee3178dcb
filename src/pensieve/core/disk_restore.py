"""Bringing a turn's chunks back from the disk tier at admission (pure Python).

Called by :meth:`~pensieve.core.tiered_cache.TieredKVCache.admit` once the turn is pinned,
after the swap-or-recompute choice of its CPU chunks and before its pending ranges are
planned. Each dropped chunk with a
verified copy on disk (:class:`~pensieve.core.disk_index.DiskIndex`, entry ``ready``) whose hash
equals that of the turn's own tokens up to the chunk's end is read into a CPU block (a free
one, or one freed by spilling the CPU tier's lowest chunk) and becomes a CPU chunk; admission
then swaps it in like any other. A copy that is ready has been read into memory (its read
time is spent), so it is always restored; the weighing of a read against recomputation
(:func:`worth_reading`, ``DiskIndex.read_chunk_s`` against the chunk's recompute cost) happens
earlier, when the turn is added and the engine chooses which files to read. A chunk is
recomputed when its copy was not read (not ready: too slow to read, or spilled while the turn
waited), or when no CPU block can be had.

A conversation that has no KV in the cache but copies on disk (after a restart: the history
came back from the conversation store) first gets dropped chunks for the leading run of
matching copies, so they are read back the same way::

    positions  0 ............. k*C | ........... num_tokens
               [on disk: read back ][computed: range from kv_end]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from pensieve.core.conversation import Chunk, Conversation, Tier
from pensieve.core.disk_index import DiskEntry, chunk_hashes
from pensieve.core.request import Request

if TYPE_CHECKING:
    from pensieve.core.eviction_index import EvictionIndex
    from pensieve.core.tier_pools import TierPools


class _Cache(Protocol):
    """What :func:`worth_reading` reads of a cache (a ``TieredKVCache``)."""

    chunk_size: int
    conversations: dict[str, Conversation]
    index: EvictionIndex


def restore_from_disk(cache: TierPools, req: Request, conv: Conversation) -> int:
    """Turn the admitted conversation's dropped chunks that are on disk into CPU chunks (a
    read planned into each block); returns their tokens."""
    disk = cache.disk
    if disk is None or cache.cpu is None or conv.conversation_id not in disk.entries:
        return 0
    c = cache.chunk_size
    tokens = req.all_token_ids
    n = min(-(-(req.num_tokens - 1) // c), max(disk.entries[conv.conversation_id]) + 1)
    hashes = chunk_hashes(tokens, c, n)
    restored = 0
    for i, ch in enumerate(conv.chunks):
        entry = disk.get(conv.conversation_id, i)
        if entry is None or ch.tier is not Tier.DROPPED:
            continue
        if not entry.ready:
            continue  # not read (slower than recomputing, or spilled since): recomputed
        n_tok = conv.chunk_tokens(i, c)
        if entry.tokens != n_tok or i * c + n_tok > len(tokens) or \
                entry.prefix_hash != _partial_hash(tokens, hashes, i, c, n_tok):
            disk.forget(conv.conversation_id, i)  # other tokens than these: never used
            continue
        block = _cpu_block(cache)
        if block is None:
            break
        disk.forget(conv.conversation_id, i)
        disk.plan.reads.append((entry, block))
        conv.chunks[i] = Chunk(Tier.CPU, block)
        restored += n_tok
    disk.forget_from(conv.conversation_id, 0)  # the rest is computed in this turn
    return restored


def _partial_hash(tokens: list[int], hashes: list[str], i: int, c: int, n_tok: int) -> str:
    """The chained hash of ``tokens[:i * c + n_tok]``."""
    if n_tok == c and i < len(hashes):
        return hashes[i]
    return chunk_hashes(tokens[:i * c + n_tok], c, i + 1)[i]


def extend_from_disk(cache: TierPools, req: Request, conv: Conversation) -> None:
    """Give an idle conversation without KV dropped chunks for the leading run of copies on
    disk that match the turn's tokens (called when its pending ranges are planned; the turn
    computes at least its last token)."""
    disk = cache.disk
    if disk is None or cache.cpu is None or conv.chunks or conv.kv_end or conv.running:
        return
    entries = disk.entries.get(conv.conversation_id)
    if not entries:
        return
    c, tokens, limit = cache.chunk_size, req.all_token_ids, req.num_tokens - 1
    hashes = chunk_hashes(tokens, c, min(-(-limit // c), max(entries) + 1))
    end = 0
    for i in range(len(hashes)):
        entry = disk.get(conv.conversation_id, i)
        if entry is None or not entry.ready or end + entry.tokens > limit:
            break
        if entry.prefix_hash != _partial_hash(tokens, hashes, i, c, entry.tokens):
            break
        end += entry.tokens
        conv.chunks.append(Chunk(Tier.DROPPED, -1))
        if entry.tokens < c:
            break
    conv.kv_end = end
    disk.forget_from(conv.conversation_id, len(conv.chunks))  # computed by this turn


def _cpu_block(cache: TierPools) -> int | None:
    """A free CPU block, or one freed by spilling the CPU tier's lowest idle chunk (tenants'
    hints that changed applied at once)."""
    block = cache.take_cpu_block(None, settle=True)
    return None if block < 0 else block


def worth_reading(cache: _Cache, entry: DiskEntry, read_chunk_s: float | None) -> bool:
    """Whether a turn should start reading ``entry`` back: reading one chunk
    (``read_chunk_s``; None: not known, always read) is no slower than recomputing it. A
    read slower than recomputation would only make the turn's step wait for bytes it could
    have recomputed sooner; a copy that was read is then always restored at admission
    (:func:`restore_from_disk`)."""
    if read_chunk_s is None:
        return True
    c = cache.chunk_size
    end = (entry.index + 1) * c
    conv = cache.conversations.get(entry.conversation_id)
    if conv is not None and entry.index * c < conv.kv_end < end:  # its last, partial chunk
        end = conv.kv_end
    return read_chunk_s <= cache.index.cost(end)
