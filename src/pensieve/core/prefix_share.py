"""Shared prefixes: full chunks with equal tokens at equal positions held once on the GPU.

A full chunk is identified by a chained hash (vLLM's scheme): chunk ``i``'s hash covers its
parent's hash and its ``C`` token ids, and the chain is seeded with a *salt*
(:func:`share_salt`): the tenant (the API key) and the request's ``cache_salt``, so that two
tenants never share a block (nor learn from a hit or its timing) unless the server runs with
``--share-prefixes-across-tenants``. Hashes are 16-byte BLAKE2b digests, so equal hashes mean
equal tokens (no collision is expected in practice; Python's ``hash`` would not do).

Which blocks are shared. When a turn ends, each full GPU chunk of its conversation whose
tokens are in the history (its KV finished, never written again) is *registered*: its hash
maps to its block. At admission, a conversation's dropped chunks and a new conversation's
leading chunks whose hash is registered take a *reference* to that block instead of being
recomputed (``CacheStats.shared_hit_tokens``). A partial last chunk is never registered: a
conversation only writes into its own chunks past its shared ones, so copy-on-write never
has to copy::

    conversation A   [sys 0][sys 1][sys 2][A's question ...)
    conversation B   [sys 0][sys 1][sys 2][B's question ...)     one GPU block per [sys i]

Only the GPU tier shares: a shared chunk leaving the GPU for one sharer (eviction,
suspension) drops that sharer's reference and its chunk becomes dropped (it re-shares at its
next admission if the block is still there); only the last reference moves the block to the
CPU tier or drops it, as for any private chunk. So the block leaves the GPU only when every
sharer has evicted it: an approximation of "value a shared chunk by the sum of its sharers'
values" that needs no change to the eviction index (each sharer's entry keeps its own key;
the block survives until the last, i.e. the highest-valued, sharer lets it go).

Invariants (:meth:`PrefixShare.check`): ``by_hash`` and ``hash_of`` are inverse maps; every
registered block is a GPU block held by ``refs[block]`` chunks (unregistered blocks by one);
``pins[block]`` is the number of running conversations holding it.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import TYPE_CHECKING

from pensieve.core.conversation import Chunk, Conversation, Tier
from pensieve.core.request import Request

if TYPE_CHECKING:
    from pensieve.core.tier_pools import TierPools


def share_salt(tenant: str, cache_salt: str | None, across_tenants: bool) -> bytes:
    """The seed of a request's chunk hashes: its tenant's (unless ``across_tenants``) and its
    own ``cache_salt``'s. Different salts never give equal hashes."""
    parts = ("" if across_tenants else tenant, cache_salt or "")
    return hashlib.blake2b("\x00".join(parts).encode(), digest_size=16).digest()


def extend_hashes(hashes: list[bytes], salt: bytes, tokens: list[int], chunk_size: int,
                  n_chunks: int) -> None:
    """Append the chained hashes of full chunks ``len(hashes)..n_chunks-1`` of ``tokens``
    (``hashes`` already holds those of the chunks before, under ``salt``)."""
    c = chunk_size
    prev = hashes[-1] if hashes else salt
    for i in range(len(hashes), n_chunks):
        prev = hashlib.blake2b(prev + array("q", tokens[i * c:(i + 1) * c]).tobytes(),
                               digest_size=16).digest()
        hashes.append(prev)


class PrefixShare:
    """The GPU tier's registered blocks: hash -> block, and per block its references (chunks
    holding it) and pins (running conversations holding it)."""

    def __init__(self) -> None:
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.refs: dict[int, int] = {}
        """Chunks holding each registered block (>= 1)."""
        self.pins: dict[int, int] = {}
        """Running conversations holding each registered block (absent: none)."""
        self.num_refs = 0
        """Chunks holding a registered block (the sharing ratio is this over ``len``)."""

    def __len__(self) -> int:
        return len(self.hash_of)

    def lookup(self, h: bytes) -> int | None:
        """The registered block of hash ``h``, if any."""
        return self.by_hash.get(h)

    def register(self, h: bytes, block: int) -> bool:
        """Register a private block (one chunk holds it) under ``h``; False if ``h`` already
        has a block (the chunk stays private)."""
        if h in self.by_hash:
            return False
        self.by_hash[h] = block
        self.hash_of[block] = h
        self.refs[block] = 1
        self.num_refs += 1
        return True

    def ref(self, block: int) -> None:
        """One more chunk holds the registered ``block``."""
        self.refs[block] += 1
        self.num_refs += 1

    def unref(self, block: int) -> bool:
        """One chunk lets ``block`` go; True when the block itself must leave (it was
        private, or this was its last reference: then it is unregistered)."""
        n = self.refs.get(block)
        if n is None:
            return True
        self.num_refs -= 1
        if n > 1:
            self.refs[block] = n - 1
            return False
        del self.refs[block]
        del self.by_hash[self.hash_of.pop(block)]
        self.pins.pop(block, None)
        return True

    def shared(self, block: int) -> bool:
        """Whether another chunk holds ``block`` too (leaving drops only a reference)."""
        return self.refs.get(block, 1) > 1

    def pin(self, block: int) -> bool:
        """A running conversation holds ``block``; True if no other one did (it becomes
        pinned)."""
        if block not in self.refs:
            return True
        n = self.pins.get(block, 0)
        self.pins[block] = n + 1
        return n == 0

    def unpin(self, block: int) -> bool:
        """A running conversation stops holding ``block``; True if it was the last one."""
        n = self.pins.get(block)
        if n is None:
            return True
        if n > 1:
            self.pins[block] = n - 1
            return False
        del self.pins[block]
        return True

    def is_pinned(self, block: int) -> bool:
        """Whether a running conversation holds the registered ``block``."""
        return block in self.pins

    def check(self, holders: dict[int, int], running_holders: dict[int, int]) -> None:
        """Raise AssertionError unless the maps agree with ``holders`` (GPU block -> chunks
        holding it) and ``running_holders`` (GPU block -> running conversations holding it)."""
        assert len(self.by_hash) == len(self.hash_of) == len(self.refs), "share map sizes"
        assert self.num_refs == sum(self.refs.values()), "reference count total"
        for h, b in self.by_hash.items():
            assert self.hash_of[b] == h, f"block {b}: hash maps disagree"
        for b, n in holders.items():
            assert n == self.refs.get(b, 1), f"GPU block {b}: {n} holders, refs {self.refs.get(b)}"
        for b in self.refs:
            assert b in holders, f"registered GPU block {b} held by no chunk"
        for b in self.pins:
            assert b in self.refs, f"pinned block {b} not registered"
        for b, n in running_holders.items():
            if b in self.refs:
                assert self.pins.get(b, 0) == n, f"GPU block {b}: pins {self.pins.get(b)} != {n}"


def request_hashes(req: Request, conv: Conversation, chunk_size: int, n: int) -> list[bytes]:
    """The chained hashes of the turn's first ``n`` full chunks (cached on the request, and
    begun from the conversation's own for its history when the salts agree)."""
    h = req.share_hashes
    if h is None:
        same = conv.share_salt == req.share_salt
        h = conv.share_hashes[:len(conv.token_ids) // chunk_size] if same else []
        req.share_hashes = h
    if len(h) < n:
        extend_hashes(h, req.share_salt, req.all_token_ids, chunk_size, n)
    return h


def find_shared(pools: TierPools, req: Request,
                conv: Conversation) -> tuple[list[tuple[int, int]], list[int]]:
    """Registered blocks the admitted turn can take instead of computing: ``(index, block)``
    for its dropped full chunks, and the blocks of a conversation without KV's leading full
    chunks (up to the first miss). Only chunks wholly before the turn's last token (which is
    always computed) qualify. Changes nothing."""
    share = pools.share
    if share is None or not share.by_hash:
        return [], []
    c = pools.chunk_size
    limit = (req.num_tokens - 1) // c  # full chunks before the last token
    chunks = conv.chunks
    found: list[tuple[int, int]] = []
    ext: list[int] = []
    if not chunks and conv.kv_end == 0:
        hashes = request_hashes(req, conv, c, limit)
        lookup = share.by_hash.get
        for i in range(limit):
            b = lookup(hashes[i])
            if b is None:
                break
            ext.append(b)
        return found, ext
    limit = min(limit, conv.kv_end // c)
    dropped = [i for i in range(limit) if chunks[i].tier is Tier.DROPPED]
    if dropped:
        hashes = request_hashes(req, conv, c, dropped[-1] + 1)
        for i in dropped:
            b = share.by_hash.get(hashes[i])
            if b is not None:
                found.append((i, b))
    return found, ext


def take_shared(pools: TierPools, conv: Conversation, found: list[tuple[int, int]],
                ext: list[int]) -> int:
    """Make the chunks :func:`find_shared` found references to their blocks; returns their
    tokens."""
    share = pools.share
    assert share is not None
    chunks = conv.chunks
    for i, b in found:
        chunks[i].tier, chunks[i].block = Tier.GPU, b
        share.ref(b)
    for b in ext:
        chunks.append(Chunk(Tier.GPU, b))
        share.ref(b)
    if ext:
        conv.kv_end = len(chunks) * pools.chunk_size
    return (len(found) + len(ext)) * pools.chunk_size


def register_chunks(pools: TierPools, req: Request, conv: Conversation) -> None:
    """The turn ended (its conversation is idle, its history set): register its full GPU
    chunks within the history that are not registered yet, and keep their hashes on the
    conversation."""
    share = pools.share
    if share is None:
        return
    c = pools.chunk_size
    n = min(conv.kv_end, len(conv.token_ids)) // c
    hashes = request_hashes(req, conv, c, n)
    refs = share.refs
    for i in range(n):
        ch = conv.chunks[i]
        if ch.tier is Tier.GPU and ch.block not in refs:
            share.register(hashes[i], ch.block)
    conv.share_hashes, conv.share_salt = hashes, req.share_salt
