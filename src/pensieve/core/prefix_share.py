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

Only the GPU tier shares: a shared chunk leaving the GPU for one sharer (a suspension, the
eviction fallback) drops that sharer's reference and its chunk becomes dropped (it re-shares at
its next admission if the block is still there); only the last reference moves the block to the
CPU tier or drops it, as for any private chunk. Eviction values a shared block above every
chunk held alone: it is no eviction candidate while shared, and leaves only once nothing else
is left (:mod:`pensieve.core.shared_eviction`).

Invariants (:meth:`PrefixShare.check`): ``by_hash`` and ``hash_of`` are inverse maps (an
unregistered block's ``hash_of`` entry is ``b""``); every registered block is a GPU block held
by ``refs[block]`` chunks (``refs[block] == 0``: unregistered, held by at most one);
``pins[block]`` is the number of running conversations holding it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from pensieve.core.conversation import Conversation, Tier


def share_salt(tenant: str, cache_salt: str | None, across_tenants: bool) -> bytes:
    """The seed of a request's chunk hashes: its tenant's (unless ``across_tenants``) and its
    own ``cache_salt``'s. Different salts never give equal hashes."""
    parts = ("" if across_tenants else tenant, cache_salt or "")
    return hashlib.blake2b("\x00".join(parts).encode(), digest_size=16).digest()


def extend_hashes(hashes: list[bytes], salt: bytes, tokens: list[int],
                  chunk_size: int) -> None:
    """Append the chained hashes of the full chunks whose tokens ``tokens`` are (the chunks
    after the ``len(hashes)`` ones ``hashes`` holds, under ``salt``; a partial rest is left
    out). Hot: every full chunk an ended turn computed is hashed once. The tokens are packed
    in one call (8-byte little-endian ints) and each chunk's digest starts from a copy of an
    empty BLAKE2b state (cheaper than building one with its parameters)."""
    n = len(tokens) // chunk_size * chunk_size
    if not n:
        return
    data = _pack(f"<{n}q", *tokens) if n == len(tokens) else _pack(f"<{n}q", *tokens[:n])
    prev = hashes[-1] if hashes else salt
    step = 8 * chunk_size
    new_state, append = _EMPTY.copy, hashes.append
    for lo in range(0, 8 * n, step):
        h = new_state()
        h.update(prev)
        h.update(data[lo:lo + step])
        prev = h.digest()
        append(prev)


_EMPTY = hashlib.blake2b(digest_size=16)
"""An empty 16-byte BLAKE2b state, copied for each chunk's digest (never updated itself)."""
_pack = struct.pack


class PrefixShare:
    """The GPU tier's registered blocks: hash -> block, and per block its references (chunks
    holding it) and pins (running conversations holding it). Registration
    (``share_admission.register_chunks``), pins (``TierPools.pin``) and a chunk leaving the GPU
    (``TierPools._leave_gpu``) update these maps in place on their hot paths.

    ``hash_of`` and ``refs`` are lists indexed by GPU block (``num_blocks`` entries), not
    dictionaries: registering or unregistering a block writes two list slots and one
    dictionary entry (``by_hash``) rather than three dictionary entries, on the path that
    every chunk an ended turn brought back to the GPU takes."""

    def __init__(self, num_blocks: int) -> None:
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: list[bytes] = [b""] * num_blocks
        """Each GPU block's hash (``b""``: unregistered)."""
        self.refs: list[int] = [0] * num_blocks
        """Chunks holding each registered GPU block (>= 1; 0: unregistered)."""
        self.pins: dict[int, int] = {}
        """Running conversations holding each registered block (absent: none)."""
        self.num_refs = 0
        """Chunks holding a registered block (the sharing ratio is this over ``len``)."""

    def __len__(self) -> int:
        return len(self.by_hash)

    def ref(self, block: int) -> None:
        """One more chunk holds the registered ``block``."""
        self.refs[block] += 1
        self.num_refs += 1

    def register_block(self, block: int, h: bytes) -> int:
        """An unregistered ``block`` whose chunk hashes to ``h``: registered as ``h``'s block
        with its one reference, unless ``h`` has one already; returns ``h``'s block (the
        other: the caller's chunk takes a reference to it and lets its own go)."""
        other = self.by_hash.setdefault(h, block)
        if other == block:
            self.hash_of[block] = h
            self.refs[block] = 1
        else:
            self.refs[other] += 1
        self.num_refs += 1
        return other

    def leave(self, block: int) -> tuple[int, bytes]:
        """An idle chunk lets the registered ``block`` go: its references before and its
        hash. The last reference unregisters the block (the caller then keeps or frees it)."""
        n, h = self.refs[block], self.hash_of[block]
        self.num_refs -= 1
        self.refs[block] = n - 1
        if n == 1:
            del self.by_hash[h]
            self.hash_of[block] = b""
        return n, h

    def unref(self, block: int) -> bool:
        """One chunk lets ``block`` go; True when the block itself must leave (it was
        private, or this was its last reference: then it is unregistered)."""
        n = self.refs[block]
        if not n:
            return True
        self.num_refs -= 1
        self.refs[block] = n - 1
        if n > 1:
            return False
        del self.by_hash[self.hash_of[block]]
        self.hash_of[block] = b""
        self.pins.pop(block, None)
        return True

    def make_private(self, block: int) -> bool:
        """The chunk holding ``block`` is to be written (it became partial): unregister the
        block if that chunk is its only holder; False if others hold it (the chunk must let
        it go instead)."""
        n = self.refs[block]
        if not n:
            return True
        if n > 1:
            return False
        return self.unref(block)

    def unpin_blocks(self, blocks: Sequence[int]) -> int:
        """A running conversation that pinned these registered GPU ``blocks``
        (``Conversation.pinned_shared``) stops running: each loses a pin; returns how many
        are no longer pinned by anyone (inline: a hot path)."""
        pins, unpinned = self.pins, 0
        for b in blocks:
            n = pins.get(b)
            if n is None:
                unpinned += 1
            elif n > 1:
                pins[b] = n - 1
            else:
                del pins[b]
                unpinned += 1
        return unpinned

    def truncated(self, conv: Conversation, chunk_size: int) -> None:
        """``conv`` lost its chunks past ``kv_end``: its cached hashes go as far, and a last
        chunk left partial (the next turn writes into it) holds no shareable block:
        copy-on-write, the block is let go (the chunk is dropped, its positions recomputed),
        or unregistered where the chunk was its only holder. The caller re-indexes ``conv``."""
        del conv.share_hashes[conv.kv_end // chunk_size:]  # the history may change there
        part = conv.kv_end // chunk_size
        if conv.kv_end % chunk_size and part < len(conv.chunks):
            ch = conv.chunks[part]
            if ch.tier is Tier.GPU and not self.make_private(ch.block):
                self.unref(ch.block)
                ch.tier, ch.block = Tier.DROPPED, -1

    def check(self, holders: dict[int, int], running_holders: dict[int, int]) -> None:
        """Raise AssertionError unless the maps agree with ``holders`` (GPU block -> chunks
        holding it) and ``running_holders`` (GPU block -> running conversations holding it)."""
        registered = [b for b, n in enumerate(self.refs) if n]
        assert len(self.by_hash) == len(registered), "share map sizes"
        assert len(registered) == sum(1 for h in self.hash_of if h), "share map sizes"
        assert self.num_refs == sum(self.refs), "reference count total"
        for h, b in self.by_hash.items():
            assert h and self.hash_of[b] == h, f"block {b}: hash maps disagree"
        for b, n in holders.items():
            assert n == (self.refs[b] or 1), f"GPU block {b}: {n} holders, refs {self.refs[b]}"
        for b in registered:
            assert b in holders, f"registered GPU block {b} held by no chunk"
        for b in self.pins:
            assert self.refs[b], f"pinned block {b} not registered"
            assert b in running_holders, f"pinned block {b} held by no running conversation"
        for b, n in running_holders.items():
            if self.refs[b]:
                assert self.pins.get(b, 0) == n, f"GPU block {b}: pins {self.pins.get(b)} != {n}"

