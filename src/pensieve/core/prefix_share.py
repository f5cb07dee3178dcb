"""Shared prefixes: the content hash that names a full chunk, whoever holds it.

A full chunk is identified by a chained hash (vLLM's scheme): chunk ``i``'s hash covers its
parent's hash and its ``C`` token ids, and the chain is seeded with a *salt*
(:func:`share_salt`): the tenant (the API key) and the request's ``cache_salt``, so that two
tenants never share a block (nor learn from a hit or its timing) unless the server runs with
``--share-prefixes-across-tenants``. Hashes are 16-byte BLAKE2b digests, so equal hashes mean
equal tokens (no collision is expected in practice; Python's ``hash`` would not do).

Which blocks are shared, and the one record each shared block has across the tiers (its
slots, references, pins and pending reads): :mod:`pensieve.core.block_map`. The disk tier names
its files by these hashes too (:mod:`pensieve.core.disk_index`).
"""

from __future__ import annotations

import hashlib
import struct


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
