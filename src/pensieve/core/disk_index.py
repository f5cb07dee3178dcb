"""The disk tier's bookkeeping: which chunks of which conversation have a copy on disk.

A third tier below the CPU tier (``--disk-kv-gb``, ``--disk-kv-path``). Pure Python: the
cache decides, :mod:`pensieve.engine.disk_tier` moves the bytes (one file per chunk).

Life of a chunk on disk::

    CPU tier --(dropped by the retention order: spill)--> write planned --> on disk
    on disk --(its turn is queued: the engine reads and verifies the file)--> ready
    ready --(the turn is admitted: restore)--> read into a CPU block --> swapped in

In the cache's chunk map a chunk on disk is *dropped* (it holds no block); this index says
that it may come back from disk instead of being recomputed. A chunk is identified by its
conversation id, its index and a chained hash of the conversation's tokens up to its end
(:func:`chunk_hashes`), so a copy is only used for the very tokens it was computed for: after a
restart, or after the history was rewritten, a copy whose hash differs is never read.

Invariants (:meth:`DiskIndex.check`): at most ``capacity`` entries; the order heap has one
live item per entry; an entry is for a dropped chunk of its conversation, or its conversation
has no chunks in the cache (files found at start). An admission consumes all of a
conversation's entries: those read back become CPU chunks, the others are forgotten (every
chunk of a running conversation is on the GPU).

Eviction order: the policy's key of the chunk when it was spilled (lowest leaves first;
entries found on disk at start, whose key is unknown, go before every spilled one, oldest
first). A spill whose key is lower than the lowest entry's is not written (the chunk is
dropped, as without a disk tier).
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from pensieve.core.conversation import Conversation, Tier
from pensieve.core.eviction import EvictionKey

DiskKey = tuple[int, float, EvictionKey]
"""Order of disk entries: ``(0, written_at, NO_KEY)`` for entries found at start, ``(1, 0.0,
key)`` for spilled ones (``key``: the policy's :data:`~pensieve.core.eviction.EvictionKey`)."""

NO_KEY: EvictionKey = (0.0, 0.0, "", 0.0)


def spilled_key(key: EvictionKey) -> DiskKey:
    """The disk order of a chunk spilled with the policy's ``key``."""
    return (1, 0.0, key)


def found_key(written_at: float) -> DiskKey:
    """The disk order of an entry found on disk at start (written at ``written_at``)."""
    return (0, written_at, NO_KEY)


def chunk_hashes(tokens: list[int], chunk_size: int, n_chunks: int) -> list[str]:
    """Chained hashes of the first ``n_chunks`` chunks of ``tokens``: chunk ``i``'s hash
    covers ``tokens[:(i + 1) * chunk_size]`` (the last one may be partial: it covers what
    there is)."""
    out: list[str] = []
    prev = b""
    for i in range(n_chunks):
        part = tokens[i * chunk_size:(i + 1) * chunk_size]
        h = hashlib.blake2b(prev + array("q", part).tobytes(), digest_size=16)
        prev = h.digest()
        out.append(h.hexdigest())
    return out


def spill_chunk(disk: DiskIndex, conv: Conversation, i: int, chunk_size: int,
                key_now: Callable[[Conversation, int], EvictionKey]) -> int:
    """Chunk ``i`` of an idle ``conv`` (its bytes in its CPU or GPU block) leaves the cache
    by the retention order: plan its write to ``disk`` if its tokens are in the history and
    the disk takes it (keyed by ``key_now``, the policy's key now); returns the tokens planned
    (0: none). Call it before the block is freed."""
    c = chunk_size
    ch = conv.chunks[i]
    n_tok = conv.chunk_tokens(i, c)
    history = conv.token_ids
    if n_tok == 0 or i * c + n_tok > len(history):
        return 0  # KV of a suspended turn beyond the history: no tokens to check it against
    if n_tok == c:
        h = disk.hashes_of(conv.conversation_id, history, i + 1)[i]
    else:
        h = chunk_hashes(history[:i * c + n_tok], c, i + 1)[i]
    if disk.spill(conv.conversation_id, i, n_tok, h, spilled_key(key_now(conv, i)), ch.block,
                  ch.tier is Tier.GPU):
        return n_tok
    return 0


def require_cpu_tier(num_cpu_blocks: int) -> None:
    """The disk tier lies below the CPU tier (its reads land in CPU blocks): ValueError when
    that tier has no blocks."""
    if num_cpu_blocks <= 0:
        raise ValueError("the disk tier lies below the CPU tier, which has no blocks: give it "
                         "some (--cpu-kv-gb) or leave --disk-kv-gb out")


def file_name(conversation_id: str, index: int) -> str:
    """The file of chunk ``index`` of a conversation (the id is hashed: any string is safe)."""
    cid = hashlib.blake2b(conversation_id.encode(), digest_size=12).hexdigest()
    return f"{cid}-{index:06d}.kv"


@dataclass
class DiskEntry:
    """One chunk's copy on disk."""

    conversation_id: str
    index: int
    tokens: int
    """Tokens of the chunk the copy holds (the last chunk may be partial)."""
    prefix_hash: str
    """:func:`chunk_hashes` of the conversation's tokens up to the chunk's end."""
    key: DiskKey
    ready: bool = False
    """Read and verified by the engine (its bytes wait in memory for the restore)."""

    @property
    def name(self) -> str:
        return file_name(self.conversation_id, self.index)


@dataclass
class DiskPlan:
    """The disk I/O a step needs, applied by the engine before the step's copies."""

    writes: list[tuple[bool, int, DiskEntry]] = field(default_factory=list)
    """(from_gpu, block, entry): copy the block's bytes (a CPU-tier block, or a GPU one of a
    chunk dropped from the GPU) now, before any copy or compute of this step touches the
    block, and write them in the background."""
    reads: list[tuple[DiskEntry, int]] = field(default_factory=list)
    """(entry, cpu_block): put the entry's verified bytes into the block before the step's
    swap-ins."""
    deletes: list[str] = field(default_factory=list)
    """File names no longer wanted."""

    def __bool__(self) -> bool:
        return bool(self.writes or self.reads or self.deletes)


class DiskIndex:
    """Chunks on disk by conversation, in their own eviction order, and the step's disk
    plan."""

    def __init__(self, capacity: int, chunk_size: int) -> None:
        if capacity < 0:
            raise ValueError(f"disk capacity must be >= 0 chunks, got {capacity}")
        self.capacity = capacity
        self.chunk_size = chunk_size
        self.entries: dict[str, dict[int, DiskEntry]] = {}
        """conversation id -> chunk index -> entry."""
        self._heap: list[tuple[DiskKey, int, str, int]] = []
        """(key, seq, conversation id, index); an item is live if its entry still has that
        seq (lazy deletion)."""
        self._seq: dict[tuple[str, int], int] = {}
        self._counter = 0
        self.size = 0
        self.plan = DiskPlan()
        self.read_chunk_s: float | None = None
        """Seconds to read one chunk at the measured (or configured) disk rate; the restore
        recomputes a chunk when that is sooner. None: always read."""
        self.evicted_tokens = 0
        self._hash_memo: dict[str, tuple[list[int], int, list[str]]] = {}

    # ------------------------------------------------------------------ queries
    def get(self, conversation_id: str, index: int) -> DiskEntry | None:
        return self.entries.get(conversation_id, {}).get(index)

    def of(self, conversation_id: str) -> list[DiskEntry]:
        """The conversation's entries by chunk index."""
        return [e for _, e in sorted(self.entries.get(conversation_id, {}).items())]

    def hashes_of(self, conversation_id: str, tokens: list[int], n_chunks: int) -> list[str]:
        """:func:`chunk_hashes` of a conversation's history, memoised while the history list
        and its length stay the same."""
        memo = self._hash_memo.get(conversation_id)
        if memo is not None and memo[0] is tokens and memo[1] == len(tokens) and \
                len(memo[2]) >= n_chunks:
            return memo[2]
        full = chunk_hashes(tokens, self.chunk_size, -(-len(tokens) // self.chunk_size))
        self._hash_memo[conversation_id] = (tokens, len(tokens), full)
        return full

    # ------------------------------------------------------------------ changes
    def add(self, entry: DiskEntry) -> bool:
        """Take ``entry`` if there is room, or room made by evicting entries of lower key;
        False (nothing changed) otherwise."""
        if self.capacity == 0:
            return False
        old = self.get(entry.conversation_id, entry.index)
        if old is not None:
            self.forget(entry.conversation_id, entry.index)
        while self.size >= self.capacity:
            top = self._live_top()
            if top is None or entry.key < top[0]:
                return False
            victim = self.entries[top[2]][top[3]]
            self.evicted_tokens += victim.tokens
            self.forget(top[2], top[3])
        self.entries.setdefault(entry.conversation_id, {})[entry.index] = entry
        self._counter += 1
        self._seq[(entry.conversation_id, entry.index)] = self._counter
        heapq.heappush(self._heap, (entry.key, self._counter, entry.conversation_id,
                                    entry.index))
        self.size += 1
        return True

    def spill(self, conversation_id: str, index: int, tokens: int, prefix_hash: str,
              key: DiskKey, block: int, from_gpu: bool) -> bool:
        """A chunk leaves the cache by the retention order: plan its write (its bytes are
        copied from ``block`` before this step's copies). False: no room for it."""
        entry = DiskEntry(conversation_id, index, tokens, prefix_hash, key)
        if not self.add(entry):
            return False
        self.plan.writes.append((from_gpu, block, entry))
        return True

    def forget(self, conversation_id: str, index: int, delete_file: bool = True) -> None:
        """Drop one entry (its file is deleted by the engine)."""
        entries = self.entries.get(conversation_id)
        if entries is None or index not in entries:
            return
        entry = entries.pop(index)
        if not entries:
            del self.entries[conversation_id]
            self._hash_memo.pop(conversation_id, None)
        del self._seq[(conversation_id, index)]
        self.size -= 1
        self.plan.writes = [w for w in self.plan.writes if w[2] is not entry]
        self.plan.reads = [(e, b) for e, b in self.plan.reads if e is not entry]
        if delete_file:
            self.plan.deletes.append(entry.name)

    def forget_from(self, conversation_id: str, keep: int) -> None:
        """Drop the conversation's entries of chunk ``keep`` on (its history was cut)."""
        for i in [i for i in self.entries.get(conversation_id, {}) if i >= keep]:
            self.forget(conversation_id, i)

    def set_ready(self, conversation_id: str, index: int, ok: bool) -> None:
        """The engine read the entry's file: verified (``ok``), or not (the entry goes)."""
        entry = self.get(conversation_id, index)
        if entry is None:
            return
        if ok:
            entry.ready = True
        else:
            self.forget(conversation_id, index)

    def take_plan(self) -> DiskPlan:
        plan, self.plan = self.plan, DiskPlan()
        return plan

    def _live_top(self) -> tuple[DiskKey, int, str, int] | None:
        heap = self._heap
        while heap:
            top = heap[0]
            if self._seq.get((top[2], top[3])) == top[1]:
                return top
            heapq.heappop(heap)
        return None

    def check(self) -> None:
        """Assert the invariants of the module docstring (over this index alone)."""
        n = sum(len(v) for v in self.entries.values())
        assert n == self.size == len(self._seq), (n, self.size, len(self._seq))
        assert self.size <= self.capacity, (self.size, self.capacity)
        live = [t for t in self._heap if self._seq.get((t[2], t[3])) == t[1]]
        assert len(live) == self.size, (len(live), self.size)
        for cid, entries in self.entries.items():
            for i, e in entries.items():
                assert (e.conversation_id, e.index) == (cid, i), e
                assert 0 < e.tokens <= self.chunk_size, e
