"""Bringing a turn's chunks back from the disk tier at admission (pure Python).

Called by :meth:`~pensieve.core.tiered_cache.TieredKVCache.admit` once the turn is pinned,
after the swap-or-recompute choice of its CPU chunks and before its pending ranges are
planned. Each dropped chunk with a verified copy on disk
(:class:`~pensieve.core.disk_index.DiskIndex`, entry ``ready``) of the turn's own tokens is
read into a CPU block (a free one, or one freed by spilling the CPU tier's lowest chunk) and
becomes a CPU chunk; admission then swaps it in like any other. A full chunk's copy is found
by its shared-prefix hash under the turn's salt (whichever conversation spilled it: within
the tenant, or across tenants with ``--share-prefixes-across-tenants``), a partial one among
the conversation's own. A copy that is ready has been read into memory (its read time is
spent), so it is always restored; the weighing of a read against recomputation
(:func:`worth_reading`, ``DiskIndex.read_chunk_s`` against the chunk's recompute cost)
happens earlier, when the turn is added and the engine chooses which files to read. A chunk
is recomputed when its copy was not read (not ready: too slow to read, spilled while the
turn waited, or its bytes let go from memory since), or when no CPU block can be had. A
copy restored stays ready while the engine keeps its bytes (other turns of its salt may
restore it too). The conversation then lets go of its copies (:meth:`DiskIndex.release`).

A conversation that has no KV in the cache (a new one, or one after a restart or on a server
that takes it over: the history came back from the conversation store) first gets dropped
chunks for the leading run of matching copies, so they are read back the same way; a chunk of
the run that is not on disk but whose hash has a shared block on the GPU (a system prompt
other conversations hold) continues the run, and admission takes it from the GPU
(``BlockMap.find``)::

    positions  0 ............. k*C | ........... num_tokens
               [on disk: read back ][computed: range from kv_end]

Both record the turn's salt (``DiskIndex.salts``): it names the conversation's full chunks
when they are spilled later.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from pensieve.core.block_map import request_hashes
from pensieve.core.conversation import Chunk, Conversation, Tier
from pensieve.core.disk_index import DiskEntry, DiskIndex, partial_hash, shared_name
from pensieve.core.request import Request

if TYPE_CHECKING:
    from pensieve.core.eviction_index import EvictionIndex
    from pensieve.core.kv_store import KVStore


class _Cache(Protocol):
    """What :func:`worth_reading` reads of a cache (a ``TieredKVCache``)."""

    chunk_size: int
    conversations: dict[str, Conversation]
    index: EvictionIndex


def _copy(disk: DiskIndex, cid: str, tokens: list[int], full: list[bytes], salt: bytes,
          i: int, n_tok: int) -> DiskEntry | None:
    """The copy of chunk ``i`` (``n_tok`` tokens of ``tokens``) on disk: a full chunk's by
    its hash (``full``: the hashes of the leading full chunks), a partial one's among the
    conversation's own whose hash matches; None: none."""
    c = disk.chunk_size
    if n_tok == c:
        return disk.files.get(shared_name(full[i].hex())) if i < len(full) else None
    entry = disk.get(cid, i)
    if entry is None or entry.tokens != n_tok or i > len(full) or \
            entry.prefix_hash != partial_hash(full[:i], salt, tokens[i * c:i * c + n_tok]):
        return None
    return entry


def restore_from_disk(cache: KVStore, req: Request, conv: Conversation) -> int:
    """Turn the admitted conversation's dropped chunks that are on disk into CPU chunks (a
    read planned into each block); returns their tokens."""
    disk = cache.disk
    if disk is None or cache.cpu is None:
        return 0
    cid = conv.conversation_id
    disk.set_salt(cid, req.share_salt)
    dropped = conv.dropped_chunks()
    restored = 0
    if dropped and disk.files:
        c, tokens, salt = cache.chunk_size, req.all_token_ids, req.share_salt
        n = dropped[-1] + 1  # the turn's hashes, cached on it (find_shared's too)
        full = request_hashes(req, conv, c, n)[:n]
        for i in dropped:
            n_tok = conv.chunk_tokens(i, c)
            if n_tok == 0 or i * c + n_tok > len(tokens):
                continue
            entry = _copy(disk, cid, tokens, full, salt, i, n_tok)
            if entry is None or not entry.ready:
                continue  # not read (slower than recomputing, or spilled since): recomputed
            block = _cpu_block(cache)
            if block is None:
                break
            disk.load(entry, block)
            conv.chunks[i] = Chunk(Tier.CPU, block)
            restored += n_tok
    disk.release_from(cid, 0)  # read back, or computed in this turn
    disk.let_go_ahead(cid)  # its chunks written ahead are the GPU's now
    return restored


def extend_from_disk(cache: KVStore, req: Request, conv: Conversation) -> None:
    """Give an idle conversation without KV dropped chunks for the leading run of copies on
    disk that match the turn's tokens (called when its pending ranges are planned; the turn
    computes at least its last token)."""
    disk = cache.disk
    if disk is None or cache.cpu is None or conv.chunks or conv.kv_end or conv.running:
        return
    if not disk.files:
        return
    cid, c, tokens, limit = conv.conversation_id, cache.chunk_size, req.all_token_ids, \
        req.num_tokens - 1
    salt = req.share_salt
    disk.set_salt(cid, salt)
    full = request_hashes(req, conv, c, limit // c)[:limit // c]  # before the last token
    if cache.blocks is not None and full:
        cache.blocks.ready_for(full[0], conv)  # its chunks looked up by hash below
    on_gpu = cache.blocks.on_gpu if cache.blocks is not None else ()
    end = kept = kept_end = 0
    for i in range(-(-limit // c)):
        entry = disk.get(cid, i)  # its partial last chunk (full in this turn's tokens)
        if entry is not None and entry.conversation_id:
            if end + entry.tokens > limit or _copy(disk, cid, tokens, full, salt, i,
                                                   entry.tokens) is not entry:
                entry = None
        elif i < len(full):
            entry = disk.files.get(shared_name(full[i].hex()))
            if (entry is None or not entry.ready) and full[i] in on_gpu:
                end += c  # a shared block on the GPU (a common prompt): taken from there
                conv.chunks.append(Chunk(Tier.DROPPED, -1))
                continue
        if entry is None or not entry.ready:
            break
        end += entry.tokens  # on disk if its copy is the conversation's hold, else found
        conv.chunks.append(Chunk(Tier.DISK if disk.get(cid, i) is entry else Tier.DROPPED, -1))
        kept, kept_end = len(conv.chunks), end
        if entry.tokens < c:
            break
    del conv.chunks[kept:]  # GPU blocks after the last copy: shared as for any new turn
    conv.kv_end = kept_end
    disk.release_from(cid, len(conv.chunks))  # computed by this turn


def _cpu_block(cache: KVStore) -> int | None:
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
