"""The disk tier's bookkeeping: which chunks have a copy on disk, and who holds them.

A third tier below the CPU tier (``--disk-kv-gb``, ``--disk-kv-path``). Pure Python: the
cache decides, :mod:`pensieve.engine.disk_tier` moves the bytes (one file per chunk).

Life of a chunk on disk::

    CPU tier --(dropped by the retention order: spill)--> write planned --> on disk
    CPU tier --(next to be dropped: written ahead, the chunk stays)--> on disk, held by none
    on disk --(its turn is queued: the engine reads and verifies the file)--> ready
    ready --(the turn is admitted: restore)--> read into a CPU block --> swapped in

In the cache's chunk map a chunk on disk is *dropped* (it holds no block); this index says
that it may come back from disk instead of being recomputed.

Identity. A *full* chunk's copy is named by the chained hash of the shared prefixes
(:func:`pensieve.core.prefix_share.extend_hashes`, seeded with the conversation's salt:
its tenant and ``cache_salt``, :func:`~pensieve.core.prefix_share.share_salt`), so equal
tokens at equal positions under one salt are one file, whichever conversations spilled them,
and a restarted server recomputes the same names. A *partial* last chunk is never shared:
its file is named by conversation and index, its hash chains its tokens onto the previous
full chunk's (:func:`partial_hash`). A copy is only used for the very tokens it was computed
for: a hash that differs from the turn's own is never read.

Holders. Each entry (:class:`DiskEntry`, one per file) has the set of conversations whose
dropped chunk it is (``holders``; :attr:`DiskIndex.entries` is the same relation by
conversation and chunk index). A spill of a chunk whose file is already on disk or planned
only adds its conversation as a holder (no write). An admission consumes the conversation's
holds: copies read back become CPU chunks, and the conversation lets go of all of them. An
entry no conversation holds is kept while there is room (a new conversation with the same
prefix, or one after a restart, reads it by hash), except a partial chunk's, whose file is
deleted with its last holder. A file is deleted when its entry is evicted or fails a check.

Invariants (:meth:`DiskIndex.check`): at most ``capacity`` entries; the order heap has one
live item per entry; ``holders`` and ``entries`` are the same relation; a full chunk's entry
has no conversation and its file name is its hash; a partial one has at most one holder,
its own conversation.

Eviction order: lowest key first. Entries no one holds go first (let go longest ago first),
then entries found on disk at start (oldest first), then spilled ones by the policy's key at
the spill; an entry held by several conversations has the highest of their keys (a later
holder's spill raises it; a holder leaving does not lower it). A spill whose key is lower
than the lowest entry's is not written (the chunk is dropped, as without a disk tier). An
entry written ahead (``DiskEntry.ahead``) is keyed as if its chunk were spilled at that
step, and held by no one until its chunk's spill holds it (a chunk swapped in instead lets it
go at its conversation's admission: :meth:`DiskIndex.let_go_ahead`).
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pensieve.core.conversation import Conversation, Tier
from pensieve.core.eviction import EvictionKey
from pensieve.core.prefix_share import extend_hashes

DiskKey = tuple[int, float, EvictionKey]
"""Order of disk entries: ``(-1, n, NO_KEY)`` for entries no one holds (the ``n``-th let
go), ``(0, written_at, NO_KEY)`` for entries found at start, ``(1, 0.0, key)`` for spilled
ones (``key``: the policy's :data:`~pensieve.core.eviction.EvictionKey`)."""

NO_KEY: EvictionKey = (0.0, 0.0, "", 0.0)


def spilled_key(key: EvictionKey) -> DiskKey:
    """The disk order of a chunk spilled with the policy's ``key``."""
    return (1, 0.0, key)


def found_key(written_at: float) -> DiskKey:
    """The disk order of an entry found on disk at start (written at ``written_at``)."""
    return (0, written_at, NO_KEY)


def partial_hash(full_hashes: list[bytes], salt: bytes, part: list[int]) -> str:
    """The hash of a partial chunk of tokens ``part`` after the full chunks of
    ``full_hashes`` (their chained hashes under ``salt``)."""
    prev = full_hashes[-1] if full_hashes else salt
    return hashlib.blake2b(prev + array("q", part).tobytes(), digest_size=16).hexdigest()


def spill_chunk(disk: DiskIndex, conv: Conversation, i: int, chunk_size: int,
                key_now: Callable[[Conversation, int], EvictionKey]) -> int:
    """Chunk ``i`` of an idle ``conv`` (its bytes in its CPU or GPU block) leaves the cache
    by the retention order: plan its write to ``disk`` (or only hold its file, already on
    disk or planned) if its tokens are in the history, its salt is known (it was admitted)
    and the disk takes it (keyed by ``key_now``, the policy's key now); returns the tokens
    kept on disk (0: none). Call it before the block is freed."""
    c = chunk_size
    ch = conv.chunks[i]
    n_tok = conv.chunk_tokens(i, c)
    history = conv.token_ids
    cid = conv.conversation_id
    salt = disk.salts.get(cid)
    if salt is None or n_tok == 0 or i * c + n_tok > len(history):
        return 0  # KV of a suspended turn beyond the history: no tokens to check it against
    hashes = disk.hashes_of(cid, history, salt)
    if n_tok == c:
        entry = DiskEntry("", i, c, hashes[i].hex(), spilled_key(key_now(conv, i)))
    else:
        h = partial_hash(hashes[:i], salt, history[i * c:i * c + n_tok])
        entry = DiskEntry(cid, i, n_tok, h, spilled_key(key_now(conv, i)))
    return n_tok if disk.store(cid, entry, ch.block, ch.tier is Tier.GPU) else 0


def spill_idle(disk: DiskIndex, conversations: Iterable[Conversation], chunk_size: int,
               key_now: Callable[[Conversation, int], EvictionKey],
               apply: Callable[[], None]) -> None:
    """At shutdown: spill every idle conversation's chunks still in a tier, as the retention
    order spills them (:func:`spill_chunk`), calling ``apply`` after each planned write (so
    each is written before the next is copied out: host memory stays bounded). A chunk held
    by several conversations, or already on disk under its hash, is written once."""
    for conv in list(conversations):
        if conv.running or conv.ephemeral:
            continue
        for i, ch in enumerate(conv.chunks):
            if (ch.tier is Tier.GPU or ch.tier is Tier.CPU) \
                    and spill_chunk(disk, conv, i, chunk_size, key_now) and disk.plan:
                apply()  # its write, and deletes of entries it pushed out


def require_cpu_tier(num_cpu_blocks: int) -> None:
    """The disk tier lies below the CPU tier (its reads land in CPU blocks): ValueError when
    that tier has no blocks."""
    if num_cpu_blocks <= 0:
        raise ValueError("the disk tier lies below the CPU tier, which has no blocks: give it "
                         "some (--cpu-kv-gb) or leave --disk-kv-gb out")


def file_name(conversation_id: str, index: int) -> str:
    """The file of a partial chunk ``index`` of a conversation (the id is hashed: any string
    is safe)."""
    cid = hashlib.blake2b(conversation_id.encode(), digest_size=12).hexdigest()
    return f"{cid}-{index:06d}.kv"


def shared_name(prefix_hash: str) -> str:
    """The file of a full chunk of that shared-prefix hash (hex)."""
    return f"{prefix_hash}.kv"


@dataclass(eq=False)
class DiskEntry:
    """One chunk's copy on disk (one file)."""

    conversation_id: str
    """The conversation of a partial chunk; empty for a full chunk (anyone's, by hash)."""
    index: int
    tokens: int
    """Tokens of the chunk the copy holds (the last chunk may be partial)."""
    prefix_hash: str
    """A full chunk's shared-prefix hash (hex), or a partial one's :func:`partial_hash`."""
    key: DiskKey
    ready: bool = False
    """Read and verified by the engine (its bytes wait in memory for the restore)."""
    holders: set[str] = field(default_factory=set)
    """Conversations whose dropped chunk ``index`` this copy is."""
    remote: bool = False
    """The copy lies in the shared store below the local disk (``--kv-remote``), found there
    by a turn's lookup: read from there, and never deleted by this server (others use it)."""
    ahead: bool = False
    """Written ahead of its spill (:attr:`DiskPlan.ahead`), its chunk still in the CPU tier,
    and held by no conversation since: keyed as spilled at that step."""

    @property
    def name(self) -> str:
        if self.conversation_id:
            return file_name(self.conversation_id, self.index)
        return shared_name(self.prefix_hash)


@dataclass
class DiskPlan:
    """The disk tier's part of a step's plan (:attr:`SchedulerOutput.disk`), carried out before
    the step's copies: what the cache decided since the last step."""

    writes: list[tuple[bool, int, DiskEntry]] = field(default_factory=list)
    """(from_gpu, block, entry): copy the block's bytes (a CPU-tier block, or a GPU one of a
    chunk dropped from the GPU) now, before any copy or compute of this step touches the
    block, and write them in the background."""
    reads: list[tuple[DiskEntry, int]] = field(default_factory=list)
    """(entry, cpu_block): put the entry's verified bytes into the block before the step's
    swap-ins."""
    deletes: list[str] = field(default_factory=list)
    """File names no longer wanted."""
    ahead: list[tuple[int, DiskEntry]] = field(default_factory=list)
    """(cpu_block, entry): full chunks of the CPU tier next in the retention order, written
    ahead of their spill (:func:`~pensieve.core.write_ahead.write_ahead`): each stays in its
    block at least until the next step, so its bytes may be copied beside this step's
    compute, done before the next step's plan is carried out. Its spill then only holds the
    file: no copy on the step path."""

    def __bool__(self) -> bool:
        return bool(self.writes or self.reads or self.deletes or self.ahead)


class DiskIndex:
    """Chunks on disk by file and by holder, in their own eviction order, and the step's
    disk plan. The verbs are the memory tiers' (:class:`~pensieve.core.tier_slots.TierSlots`
    and the block pools): :meth:`lookup` by hash, :meth:`store` (a chunk leaving the CPU
    tier: hold its file or plan its write), :meth:`load` (plan a read into a CPU block),
    :meth:`pin` / :meth:`unpin` (a queued turn waits for a read) and :meth:`free`."""

    def __init__(self, capacity: int, chunk_size: int) -> None:
        if capacity < 0:
            raise ValueError(f"disk capacity must be >= 0 chunks, got {capacity}")
        self.capacity = capacity
        self.reading: dict[str, int] = {}
        """Conversation id -> reads still running that its queued turn waits for (kept by the
        disk tier's I/O through :meth:`pin` and :meth:`unpin`): the scheduler
        admits no such turn while others run, so a step does not wait for them
        (:meth:`pensieve.engine.disk_tier.DiskTier.collect`)."""
        self._awaiting: dict[str, set[str]] = {}
        """File name -> conversations whose queued turn waits for its read."""
        self.chunk_size = chunk_size
        self.files: dict[str, DiskEntry] = {}
        """File name -> entry."""
        self.entries: dict[str, dict[int, DiskEntry]] = {}
        """Conversation id -> chunk index -> the entry it holds there."""
        self.salts: dict[str, bytes] = {}
        """Each admitted conversation's salt (its last turn's): names its full chunks."""
        self._heap: list[tuple[DiskKey, int, str]] = []
        """(key, seq, file name); an item is live if its entry still has that seq (lazy
        deletion)."""
        self._seq: dict[str, int] = {}
        self._counter = 0
        self._let_go = 0
        self.plan = DiskPlan()
        self.read_chunk_s: float | None = None
        """Seconds to read one chunk at the measured (or configured) disk rate; the restore
        recomputes a chunk when that is sooner. None: always read."""
        self.evicted_tokens = 0
        self._conversations: dict[str, Conversation] = {}
        """The cache's conversations (:meth:`bind`): a chunk whose copy the index lets go
        goes from ``Tier.DISK`` to ``Tier.DROPPED``."""
        self._hash_memo: dict[str, tuple[list[int], int, bytes, list[bytes]]] = {}
        self._ahead_of: dict[str, list[DiskEntry]] = {}
        """Conversation id -> its chunks' entries written ahead (:meth:`store_ahead`)."""

    @property
    def size(self) -> int:
        return len(self.files)

    # ------------------------------------------------------------------ queries
    def get(self, conversation_id: str, index: int) -> DiskEntry | None:
        """The entry the conversation holds at chunk ``index``."""
        return self.entries.get(conversation_id, {}).get(index)

    def of(self, conversation_id: str) -> list[DiskEntry]:
        """The conversation's held entries by chunk index."""
        return [e for _, e in sorted(self.entries.get(conversation_id, {}).items())]

    def lookup(self, h: bytes) -> DiskEntry | None:
        """The entry of a full chunk of hash ``h`` (:func:`shared_name`), or None."""
        return self.files.get(shared_name(h.hex()))

    def pin(self, name: str, conversation_id: str) -> bool:
        """The conversation's queued turn waits for the read of file ``name`` (once): the file
        is pinned until the read is collected (:meth:`unpin`). True: the turn waited for no
        read before."""
        waiting = self._awaiting.setdefault(name, set())
        if conversation_id in waiting:
            return False
        waiting.add(conversation_id)
        n = self.reading.get(conversation_id, 0)
        self.reading[conversation_id] = n + 1
        return n == 0

    def unpin(self, name: str) -> list[str]:
        """The read of file ``name`` was collected: its waiters wait for one read less;
        returns those that wait for none now."""
        reading, done = self.reading, []
        for waiter in self._awaiting.pop(name, ()):
            n = reading.get(waiter, 0)
            if n > 1:
                reading[waiter] = n - 1
            else:
                reading.pop(waiter, None)
                done.append(waiter)
        return done

    def live(self, entry: DiskEntry) -> bool:
        """Whether ``entry`` is still the index's entry of its file."""
        return self.files.get(entry.name) is entry

    def hashes_of(self, conversation_id: str, tokens: list[int], salt: bytes) -> list[bytes]:
        """The shared-prefix hashes of the full chunks of a conversation's history under
        ``salt``, memoised while the history list, its length and the salt stay the same."""
        memo = self._hash_memo.get(conversation_id)
        if memo is not None and memo[0] is tokens and memo[1] == len(tokens) and \
                memo[2] == salt:
            return memo[3]
        full: list[bytes] = []
        extend_hashes(full, salt, tokens, self.chunk_size)
        self._hash_memo[conversation_id] = (tokens, len(tokens), salt, full)
        return full

    def wanted(self, conversation_id: str, tokens: list[int], salt: bytes, limit: int,
               dropped: list[int] | None = None,
               hashes: list[bytes] | None = None) -> list[DiskEntry]:
        """The copies a turn of ``tokens`` (under ``salt``; positions below ``limit`` may
        come from the cache) may read back: those the conversation holds, and by hash the
        files of its full chunks in ``dropped`` (None: it has no KV, its leading full chunks
        up to the first missing file). ``hashes``: the turn's chunk hashes computed already
        (``Request.share_hashes``), extended here as far as needed."""
        out = {id(e): e for e in self.of(conversation_id)}
        if not self.files:
            return list(out.values())
        c = self.chunk_size
        n = limit // c
        hashes = [] if hashes is None else hashes
        for i in (range(n) if dropped is None else [i for i in dropped if i < n]):
            if len(hashes) <= i:
                extend_hashes(hashes, salt, tokens[len(hashes) * c:(i + 1) * c], c)
            e = self.lookup(hashes[i])
            if e is not None:
                out.setdefault(id(e), e)
            elif dropped is None:
                break
        return list(out.values())

    # ------------------------------------------------------------------ changes
    def add(self, entry: DiskEntry) -> bool:
        """Take ``entry`` (its file not in the index) if there is room, or room made by
        evicting entries of lower key; False (nothing changed) otherwise."""
        if self.capacity == 0:
            return False
        assert entry.name not in self.files, entry.name
        while self.size >= self.capacity:
            top = self._live_top()
            if top is None or entry.key < top[0]:
                return False
            victim = self.files[top[2]]
            self.evicted_tokens += victim.tokens
            self.free(victim)
        self.files[entry.name] = entry
        self._push(entry)
        return True

    def _push(self, entry: DiskEntry) -> None:
        """(Re-)key ``entry`` in the order heap; the heap is rebuilt of its live items when
        stale ones (re-keyed or dropped entries) outnumber them."""
        self._counter += 1
        self._seq[entry.name] = self._counter
        heapq.heappush(self._heap, (entry.key, self._counter, entry.name))
        if len(self._heap) > 2 * len(self._seq) + 64:
            self._heap = [t for t in self._heap if self._seq.get(t[2]) == t[1]]
            heapq.heapify(self._heap)

    def hold(self, conversation_id: str, index: int, entry: DiskEntry) -> None:
        """The conversation's dropped chunk ``index`` is ``entry``'s copy."""
        old = self.get(conversation_id, index)
        if old is entry:
            return
        if old is not None:
            self.release(conversation_id, index)
        entry.holders.add(conversation_id)
        entry.ahead = False
        self.entries.setdefault(conversation_id, {})[index] = entry

    def store(self, conversation_id: str, entry: DiskEntry, block: int,
              from_gpu: bool) -> bool:
        """A chunk of the conversation leaves the cache by the retention order: hold its
        file if one of the same name and hash is on disk or planned (its key raised to
        ``entry.key`` if lower), else plan its write (its bytes are copied from ``block``
        before this step's copies). False: no room for it."""
        have = self.files.get(entry.name)
        if have is not None and (have.tokens, have.prefix_hash) == (entry.tokens,
                                                                    entry.prefix_hash):
            if have.key < entry.key:
                have.key = entry.key
                self._push(have)
            self.hold(conversation_id, entry.index, have)
            return True
        if have is not None:  # a partial chunk's file of other tokens
            self.free(have)
        self.release(conversation_id, entry.index)
        if not self.add(entry):
            return False
        self.hold(conversation_id, entry.index, entry)
        self.plan.writes.append((from_gpu, block, entry))
        return True

    def store_ahead(self, conversation_id: str, entry: DiskEntry, block: int) -> bool:
        """A full chunk of the conversation in CPU ``block``, next to leave the CPU tier, is
        written ahead of its spill (:mod:`pensieve.core.write_ahead`): ``entry`` (no file of
        its name yet) is taken, held by no one, and its write planned in
        :attr:`DiskPlan.ahead`. False: no room for it."""
        entry.ahead = True
        if not self.add(entry):
            return False
        self.plan.ahead.append((block, entry))
        self._ahead_of.setdefault(conversation_id, []).append(entry)
        return True

    def let_go_ahead(self, conversation_id: str) -> None:
        """The conversation's turn starts (or it is deleted): its chunks written ahead and not
        spilled since left the CPU tier another way, and their files go first in the disk's
        order, as the copies a conversation lets go of (:meth:`release`)."""
        for entry in self._ahead_of.pop(conversation_id, ()):
            if entry.ahead and self.live(entry):
                entry.ahead = False
                self._let_go_of(entry)

    def release(self, conversation_id: str, index: int) -> None:
        """The conversation lets go of its copy of chunk ``index``: a partial chunk's file
        goes with it; a full one no one holds stays, first in the eviction order."""
        entries = self.entries.get(conversation_id)
        if entries is None or index not in entries:
            return
        entry = entries.pop(index)
        if not entries:
            del self.entries[conversation_id]
        self._off_disk(conversation_id, index)
        entry.holders.discard(conversation_id)
        if entry.holders:
            return
        if entry.conversation_id:
            self.free(entry)
        else:
            self._let_go_of(entry)

    def _let_go_of(self, entry: DiskEntry) -> None:
        """A full chunk's entry that no one holds now goes first in the eviction order (let
        go of later than those before it)."""
        self._let_go += 1
        entry.key = (-1, float(self._let_go), NO_KEY)
        self._push(entry)

    def release_from(self, conversation_id: str, keep: int) -> None:
        """The conversation lets go of its copies of chunk ``keep`` on."""
        for i in [i for i in self.entries.get(conversation_id, {}) if i >= keep]:
            self.release(conversation_id, i)

    def forget_from(self, conversation_id: str, keep: int) -> None:
        """The conversation's history was cut at chunk ``keep`` (0: it was deleted: its salt
        and hashes are forgotten too): it lets go of its copies from there."""
        self.release_from(conversation_id, keep)
        self._hash_memo.pop(conversation_id, None)
        if keep == 0:
            self.salts.pop(conversation_id, None)
            self.let_go_ahead(conversation_id)

    def free(self, entry: DiskEntry, delete_file: bool = True) -> None:
        """Drop one entry, from all its holders (its file is deleted by the engine, after
        this step's reads)."""
        if self.files.get(entry.name) is not entry:
            return
        del self.files[entry.name]
        del self._seq[entry.name]
        for cid in entry.holders:
            entries = self.entries[cid]
            for i in [i for i, e in entries.items() if e is entry]:
                del entries[i]
                self._off_disk(cid, i)
            if not entries:
                del self.entries[cid]
        entry.holders.clear()
        self.plan.writes = [w for w in self.plan.writes if w[2] is not entry]
        if entry.ahead:
            self.plan.ahead = [w for w in self.plan.ahead if w[1] is not entry]
        # a planned read stays: its bytes are in memory and its chunk counts on them
        if delete_file:
            self.plan.deletes.append(entry.name)

    def set_ready(self, entry: DiskEntry, ok: bool) -> None:
        """The engine read the entry's file: verified (``ok``), or not (the entry goes)."""
        if not self.live(entry):
            return
        if ok:
            entry.ready = True
        else:
            self.free(entry)

    def bind(self, conversations: dict[str, Conversation]) -> None:
        """The cache's conversations by id (the cache built over this index calls it once):
        their chunks on disk are this index's holds."""
        self._conversations = conversations

    def _off_disk(self, conversation_id: str, index: int) -> None:
        """The conversation's chunk ``index`` has no copy on disk any more: dropped."""
        conv = self._conversations.get(conversation_id)
        if conv is not None and index < len(conv.chunks):
            ch = conv.chunks[index]
            if ch.tier is Tier.DISK:
                ch.tier = Tier.DROPPED

    def set_salt(self, conversation_id: str, salt: bytes) -> None:
        """The salt of the conversation's admitted turn: names its full chunks on disk."""
        self.salts[conversation_id] = salt

    def load(self, entry: DiskEntry, cpu_block: int) -> None:
        """Plan the restore of ``entry`` (ready: its bytes read) into ``cpu_block`` before the
        step's swap-ins."""
        self.plan.reads.append((entry, cpu_block))

    def take_plan(self) -> DiskPlan:
        plan, self.plan = self.plan, DiskPlan()
        return plan

    def _live_top(self) -> tuple[DiskKey, int, str] | None:
        heap = self._heap
        while heap:
            top = heap[0]
            if self._seq.get(top[2]) == top[1]:
                return top
            heapq.heappop(heap)
        return None

    def check(self) -> None:
        """Assert the invariants of the module docstring (over this index alone)."""
        assert self.size == len(self._seq) <= self.capacity, (self.size, self.capacity)
        live = [t for t in self._heap if self._seq.get(t[2]) == t[1]]
        assert len(live) == self.size, (len(live), self.size)
        by_entry: set[tuple[str, int]] = set()
        for cid, es in self.entries.items():
            assert es, cid
            for i, e in es.items():
                assert self.files.get(e.name) is e and e.index == i and cid in e.holders, e
                by_entry.add((cid, id(e)))
        assert sum(len(e.holders) for e in self.files.values()) == \
            sum(len(es) for es in self.entries.values()), "reference counts"
        for name, e in self.files.items():
            assert e.name == name and 0 < e.tokens <= self.chunk_size, e
            assert {(c, id(e)) for c in e.holders} <= by_entry, e
            assert (e.tokens == self.chunk_size) != bool(e.conversation_id), e
            assert e.holders <= ({e.conversation_id} if e.conversation_id else e.holders), e
            assert e.holders or e.conversation_id or e.key[0] <= 0 or e.ahead, e
            assert not (e.ahead and (e.holders or e.conversation_id)), e
