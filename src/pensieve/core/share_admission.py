"""Shared prefixes at a turn's edges: the chunks an admitted turn takes from registered GPU
blocks, and the chunks an ended turn registers (pure Python; the registry and the design are
:mod:`pensieve.core.prefix_share`'s). Called by
:class:`~pensieve.core.tiered_cache.TieredKVCache` at admission and at the end of a turn."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pensieve.core.conversation import Chunk, Conversation, Tier
from pensieve.core.cpu_share import lookup_cpu
from pensieve.core.prefix_share import PrefixShare, extend_hashes
from pensieve.core.request import Request

if TYPE_CHECKING:
    from pensieve.core.tier_pools import TierPools


def request_hashes(req: Request, conv: Conversation | None, chunk_size: int,
                   n: int) -> list[bytes]:
    """The chained hashes of the turn's first ``n`` full chunks (cached on the request, and
    begun from the conversation's own when the salts agree, as far as its KV goes: a history
    rewritten since (``set_history``) kept its KV only where it kept its tokens).

    A copy, not the conversation's own list: a turn that never ends (aborted) must leave the
    conversation's hashes as they were, since its chunks past the history hold the aborted
    input's tokens, not the next turn's."""
    h = req.share_hashes
    if h is None:
        h = []  # a conversation not known yet: from the first chunk
        if conv is not None and conv.share_salt == req.share_salt:
            h = conv.share_hashes[:min(len(conv.token_ids), conv.kv_end) // chunk_size]
        req.share_hashes = h
    if len(h) < n:
        tokens = req.token_ids_range(len(h) * chunk_size, n * chunk_size)
        extend_hashes(h, req.share_salt, tokens, chunk_size)
    return h


Found = tuple[list[tuple[int, int]], list[int], list[tuple[int, int]]]
""":func:`find_shared`'s answer: ``(found, ext, cpu)``."""


def find_shared(pools: TierPools, req: Request, conv: Conversation,
                dropped: list[int]) -> Found:
    """Registered blocks the admitted turn can take instead of computing: ``found``, ``(index,
    GPU block)`` for its dropped full chunks; ``ext``, the GPU blocks of a conversation without
    KV's leading full chunks (up to the first miss); ``cpu``, ``(index, CPU block)`` for the
    chunks of either kind registered on the CPU tier but not on the GPU (for a conversation
    without KV, those right after ``ext``, up to their first miss: indices past its chunks),
    to be swapped in (:mod:`pensieve.core.cpu_share`). Only chunks wholly before the turn's
    last token (which is always computed) qualify. ``dropped``: the indices of the
    conversation's dropped chunks (ascending, :meth:`Conversation.dropped_chunks`). Changes
    nothing."""
    share, cs = pools.share, pools.cpu_share
    if share is None or not (share.by_hash or cs):
        return [], [], []
    chunks = conv.chunks
    if chunks and not dropped:  # KV and nothing dropped: nothing to take
        return [], [], []
    c = pools.chunk_size
    limit = (req.num_tokens - 1) // c  # full chunks before the last token
    found: list[tuple[int, int]] = []
    ext: list[int] = []
    cpu: list[tuple[int, int]] = []
    lookup = share.by_hash.get
    if not chunks and conv.kv_end == 0:
        hashes = request_hashes(req, conv, c, limit)
        for i in range(limit):
            b = lookup(hashes[i])
            if b is None:
                break
            ext.append(b)
        if cs:
            for i in range(len(ext), limit):
                b = lookup_cpu(pools, hashes[i])
                if b < 0:
                    break
                cpu.append((i, b))
        return found, ext, cpu
    limit = min(limit, conv.kv_end // c)
    if dropped and dropped[-1] >= limit:
        dropped = [i for i in dropped if i < limit]
    if dropped:
        hashes = request_hashes(req, conv, c, dropped[-1] + 1)
        for i in dropped:
            b = lookup(hashes[i])
            if b is not None:
                found.append((i, b))
            elif cs and (cb := lookup_cpu(pools, hashes[i])) >= 0:
                cpu.append((i, cb))
    return found, ext, cpu


def pending_ranges(req: Request, conv: Conversation, dropped: list[int], num_ext: int,
                   chunk_size: int) -> list[tuple[int, int]]:
    """The positions the turn must compute, ascending ``[lo, hi)`` ranges: the chunks
    ``dropped`` (ascending; dropped ones not taken from shared blocks), then everything from
    ``kv_end`` (or from ``num_ext`` leading chunks a conversation without KV takes from
    shared blocks)."""
    c = chunk_size
    holes: list[tuple[int, int]] = []
    for i in dropped:
        lo, hi = i * c, min((i + 1) * c, conv.kv_end)
        if holes and holes[-1][1] == lo:
            holes[-1] = (holes[-1][0], hi)
        else:
            holes.append((lo, hi))
    kv_end = num_ext * c if num_ext else conv.kv_end
    tail = (min(kv_end, req.num_tokens - 1), req.num_tokens)
    if holes and holes[-1][1] == tail[0]:
        holes[-1] = (holes[-1][0], tail[1])
    else:
        holes.append(tail)
    return holes


def pinned_by_others(share: PrefixShare, chunks: list[Chunk], tiers: list[Tier],
                     found: list[tuple[int, int]], ext: list[int]) -> int:
    """Of the GPU blocks a turn being admitted would pin (its idle conversation's GPU chunks'
    (``tiers``: theirs), and the registered ones :func:`find_shared` found), how many
    running conversations pin already (they are not among the evictable blocks). The
    conversation's own blocks can be pinned by others only if shared: while no registered
    block has two holders (the usual case without common prefixes) they are not looked up."""
    pins = share.pins
    n = sum(1 for b in ext if b in pins) + sum(1 for _, b in found if b in pins)
    if share.num_refs > len(share.by_hash):
        gpu = Tier.GPU
        n += sum(map(pins.__contains__, [ch.block for ch, t in zip(chunks, tiers) if t is gpu]))
    return n


def take_shared(pools: TierPools, conv: Conversation, found: list[tuple[int, int]],
                ext: list[int], cpu: list[tuple[int, int]]) -> int:
    """Make the chunks :func:`find_shared` found references to their blocks (CPU chunks for
    ``cpu``: the turn swaps them in); returns the tokens of those on the GPU."""
    share = pools.share
    assert share is not None
    chunks = conv.chunks
    n = len(chunks)
    for i, b in found:
        chunks[i].tier, chunks[i].block = Tier.GPU, b
        share.ref(b)
    for b in ext:
        chunks.append(Chunk(Tier.GPU, b))
        share.ref(b)
    if cpu:
        cs = pools.cpu_share
        assert cs is not None
        for i, b in cpu:
            if i < n:
                chunks[i].tier, chunks[i].block = Tier.CPU, b
            else:
                chunks.append(Chunk(Tier.CPU, b))
            cs.ref(b)
    if len(chunks) > n:
        conv.kv_end = len(chunks) * pools.chunk_size
    return (len(found) + len(ext)) * pools.chunk_size


def register_chunks(pools: TierPools, req: Request, conv: Conversation) -> None:
    """The turn ended (its conversation is idle, its history set): register its full GPU
    chunks within the history that are not registered yet (those past
    ``Conversation.share_upto`` and those brought back to the GPU by its admissions,
    ``share_back``: work in proportion to what the turn changed), and keep their hashes on
    the conversation. A chunk whose hash another block has already (computed by a turn that ran
    beside this one) takes a reference to that block and frees its own: turns that computed
    one prefix at the same time hold it once from then on."""
    share = pools.share
    if share is None:
        return
    c = pools.chunk_size
    n = min(conv.kv_end, len(conv.token_ids)) // c
    hashes = request_hashes(req, conv, c, n)
    refs = share.refs
    back, conv.share_back = conv.share_back, []
    new = range(min(conv.share_upto, n), n)
    chunks, gpu_tier = conv.chunks, Tier.GPU
    for i in [*back, *new] if back else new:
        if i >= n:
            continue
        ch = chunks[i]
        b = ch.block
        if ch.tier is not gpu_tier or refs[b]:
            continue
        other = share.register_block(b, hashes[i])
        if other != b:  # its own block is private and the turn's writes to it are done
            pools.gpu.free_one(b)
            ch.block = other
    conv.share_hashes, conv.share_salt = hashes, req.share_salt
    conv.share_upto = max(conv.share_upto, n)
