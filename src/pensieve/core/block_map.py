"""The block map: one record per shared block, across the GPU and CPU tiers.

A full chunk is named by its content hash (:func:`pensieve.core.prefix_share.extend_hashes`:
chained from its parent's and salted by tenant and ``cache_salt``). When prefixes are shared,
every full chunk whose KV is final is *registered*: its hash has one record (a row of the map,
:class:`BlockMap`), which says where that content lives (a GPU slot, a CPU slot, or both at
once), how many chunks hold each slot (its references), how many running turns pin its GPU
slot, and how many planned swap-ins still read its CPU slot. Conversations' chunks hold slots;
nothing else keeps that state::

    by_hash: {hash -> 7}        record 7: hash_of h
                                gpu: slot_of 12, refs 3, pins 1    cpu: slot_of -1, refs 0, pins 0
    gpu.at:  [..., 7 @ slot 12, ...]      cpu.at: [..., -1, ...]        (slot -> its record)
    gpu.shared: {12}                      cpu.shared: {}                (held twice or more)

Which chunks share (``TieredKVCache``, :class:`~pensieve.core.kv_store.KVStore`). An ended
turn registers its full GPU chunks (:meth:`BlockMap.register_turn`; lazily while its
conversation is the only one with its first chunk's hash: it owes them until another turn
looks that hash up, :meth:`BlockMap.ready_for`); admission makes a turn's
dropped or leading chunks references to registered slots (:meth:`BlockMap.find` and
:meth:`BlockMap.take`); a registered GPU block whose last reference leaves for the CPU
registers its CPU slot (the record keeps its place in the map); a shared GPU block moved by
the eviction fallback is copied to the CPU once and its holders follow. A partial chunk is
never registered: a conversation only writes past its shared chunks, so copy-on-write never
copies.

Reads. A swap-in reading a registered CPU slot drops the chunk's reference, and the read is
counted on the record until the store reclaims it (:meth:`BlockMap.end_reads`); a slot whose
last reference goes while reads are pending is an *orphan* (out of the map, freed when its
last read ends), so no block a planned swap-in reads is freed, moved or overwritten.

Each tier's columns are a :class:`~pensieve.core.tier_slots.TierSlots` (``BlockMap.gpu``,
``BlockMap.cpu``), with the same verbs; a GPU pin is a running turn, a CPU pin a planned
swap-in's read. The eviction index (:mod:`pensieve.core.eviction_index`) reads each tier's
``shared`` set: a chunk whose slot others hold too is no eviction
candidate (its block is worth what all its sharers would lose).

Invariants (:func:`pensieve.core.pool_audit.check_gpu` and ``check_cpu``): each record in
``by_hash`` has a slot, and each tier's ``at`` points back at it; each slot's references
equal the chunks holding it; each tier's ``shared`` is the set of its slots with two
references or more; GPU pins equal the running conversations holding the slot, CPU pins the
slot's pending reclaims; the counters equal their sums.
"""

from __future__ import annotations

from collections.abc import Container

from pensieve.core.block_pool import BlockPool
from pensieve.core.conversation import Chunk, Conversation, Tier
from pensieve.core.prefix_share import extend_hashes
from pensieve.core.request import Request
from pensieve.core.tier_slots import TierSlots

Found = tuple[list[tuple[int, int]], list[int], list[tuple[int, int]]]
""":meth:`BlockMap.find`'s answer: ``(found, ext, cpu)``."""


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


class OnGpu:
    """The hashes with a GPU slot, as a container (``h in blocks.on_gpu``)."""

    __slots__ = ("by_hash", "gpu_of")

    def __init__(self, by_hash: dict[bytes, int], gpu_of: list[int]) -> None:
        self.by_hash, self.gpu_of = by_hash, gpu_of

    def __contains__(self, h: object) -> bool:
        r = self.by_hash.get(h)  # type: ignore[call-overload]
        return r is not None and self.gpu_of[r] >= 0


class BlockMap:
    """Every registered block's record by hash, and each tier's slots' records (module
    docstring). Pure bookkeeping: the store allocates and frees the slots.

    A record is a row: its id indexes one list per field (``hash_of`` here, and each tier's
    slot, references and pins: :class:`~pensieve.core.tier_slots.TierSlots`, ``gpu`` and
    ``cpu``). Rows of ints and bytes,
    not an object per block: the cache holds a record for nearly every full chunk, and
    objects that many (the garbage collector tracks each) made every collection pass longer,
    which cost more host time per step than the bookkeeping itself. Ids of rows out of the
    map are reused."""

    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.by_hash: dict[bytes, int] = {}
        """Hash -> its record's id."""
        self.hash_of: list[bytes] = []
        """Each record's hash (b"": a free row)."""
        self.gpu = TierSlots(Tier.GPU, num_gpu_blocks, self.by_hash)
        """The GPU tier's columns: each record's GPU slot, references and pins (running
        conversations holding it)."""
        self.cpu = TierSlots(Tier.CPU, num_cpu_blocks, self.by_hash)
        """The CPU tier's columns: each record's CPU slot, references and pins (planned
        swap-ins reading it, not reclaimed yet)."""
        self.num_reads = 0
        """Pending reads of registered and orphaned CPU slots."""
        self.orphans: dict[int, int] = {}
        """CPU slots no chunk holds any more -> their pending reads (freed at the last)."""
        self.step_reads: set[int] = set()
        """Registered CPU slots this step's swap-ins read: a step reads a CPU block once (the
        runner's copy batches cut disjoint runs), so admission takes none of these."""
        self.on_gpu = OnGpu(self.by_hash, self.gpu.slot_of)
        self.free_ids: list[int] = []
        """Rows out of the map, reused."""
        self.alone: dict[bytes, Conversation] = {}
        """First-chunk hash -> the one conversation with it, whose registration is owed
        (lazy registration, :meth:`register_turn`)."""
        self.owed: dict[Conversation, bytes] = {}
        """Conversations owing registration -> their key in :attr:`alone`."""
        self.crowded: set[bytes] = set()
        """First-chunk hashes two conversations (or a conversation and a turn looking its
        chunks up) have had: their conversations register at once."""

    # ------------------------------------------------------------------ lazy registration
    def ready_for(self, h0: bytes, conv: Conversation | None = None) -> None:
        """Chunks whose first chunk hashes to ``h0`` are about to be looked up (by a turn of
        ``conv``): the conversation that owes their registration, if another, registers now,
        and conversations with that first hash register at once from now on."""
        owner = self.alone.get(h0)
        if owner is not None and owner is not conv:
            self.crowded.add(h0)
            self.pay(owner)

    def pay(self, conv: Conversation) -> None:
        """Register what ``conv`` owes (:meth:`register_turn`): its full GPU and CPU chunks
        below ``share_upto`` that its admission did not bring back (``share_back``), as an
        eager registration would hold them now; a running turn pins its GPU ones."""
        key = self.owed.pop(conv, None)
        if key is None:
            return
        if self.alone.get(key) is conv:
            del self.alone[key]
        c, hashes, chunks = self.chunk_size, conv.share_hashes, conv.chunks
        back = set(conv.share_back)
        for i in range(min(conv.share_upto, conv.kv_end // c, len(hashes), len(chunks))):
            ch = chunks[i]
            if i in back:
                continue
            if ch.tier is Tier.GPU:
                r = self._record(hashes[i])
                gpu = self.gpu
                assert gpu.slot_of[r] < 0, "an owed chunk's hash has a GPU slot"
                gpu.store(ch.block, r)
                if conv.running:
                    gpu.pin_record(r)
            elif ch.tier is Tier.CPU:
                self.register_cpu(ch.block, hashes[i])
        if conv.running:
            at = self.gpu.at
            conv.pinned_shared = [b for b in conv.block_table if at[b] >= 0]

    def forget(self, conv: Conversation) -> None:
        """``conv`` is deleted: it owes nothing."""
        key = self.owed.pop(conv, None)
        if key is not None and self.alone.get(key) is conv:
            del self.alone[key]

    def _record(self, h: bytes) -> int:
        """The id of hash ``h``'s record, a new row (a free one reused) if it has none."""
        free = self.free_ids
        fresh = free[-1] if free else len(self.hash_of)
        r = self.by_hash.setdefault(h, fresh)  # one lookup whether it has one or not
        if r == fresh:
            if free:
                free.pop()
                self.hash_of[r] = h
            else:
                self.hash_of.append(h)
                self.gpu.grow()
                self.cpu.grow()
        return r

    def _forget(self, r: int) -> bytes:
        """Record ``r`` has no slot left: out of the map, its row free (its counts are 0);
        returns its hash."""
        h = self.hash_of[r]
        del self.by_hash[h]
        self.hash_of[r] = b""
        self.free_ids.append(r)
        return h

    # ------------------------------------------------------------------ the GPU tier
    def leave_gpu(self, block: int) -> tuple[int, bytes]:
        """A chunk lets the registered GPU ``block`` go: its references before, and its hash.
        The last reference unregisters the slot (the caller keeps or frees the block)."""
        gpu = self.gpu
        r = gpu.at[block]
        assert r >= 0
        n = gpu.unref(r)
        if n == 1:
            gpu.clear_pins(r)
            if self.cpu.slot_of[r] < 0:
                return n, self._forget(r)
        return n, self.hash_of[r]

    def unref_gpu(self, block: int) -> bool:
        """A chunk lets GPU ``block`` go; True when the block itself must leave (private, or
        this was its last reference: it is unregistered)."""
        return self.gpu.at[block] < 0 or self.leave_gpu(block)[0] == 1

    def make_private(self, block: int) -> bool:
        """The chunk holding GPU ``block`` is to be written (it became partial): unregister the
        block if that chunk is its only holder; False if others hold it (the chunk must let it
        go instead)."""
        r = self.gpu.at[block]
        if r < 0:
            return True
        return self.gpu.refs[r] == 1 and self.unref_gpu(block)

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
                self.unref_gpu(ch.block)
                ch.tier, ch.block = Tier.DROPPED, -1

    # ------------------------------------------------------------------ the CPU tier
    def ref_cpu(self, block: int) -> None:
        """One more chunk holds the registered CPU ``block``."""
        r = self.cpu.at[block]
        assert r >= 0
        self.cpu.ref(r)

    def register_cpu(self, block: int, h: bytes) -> None:
        """The chunk holding the private CPU ``block`` of hash ``h`` (no CPU slot yet)
        registers it."""
        self.cpu.store(block, self._record(h))

    def moves_alone(self, block: int) -> bool:
        """The registered GPU ``block`` has one holder and its hash no CPU slot: when that
        chunk goes to the CPU, the record goes along (:meth:`move_to_cpu`)."""
        r = self.gpu.at[block]
        return r >= 0 and self.gpu.refs[r] == 1 and self.cpu.slot_of[r] < 0

    def move_to_cpu(self, gpu_block: int, cpu_block: int) -> None:
        """The one holder of the registered ``gpu_block`` (:meth:`moves_alone`) moves to
        ``cpu_block``: the record keeps its place in the map, its slot changes tier."""
        r = self.gpu.at[gpu_block]
        self.gpu.unref(r)
        self.cpu.store(cpu_block, r)

    def _unref_cpu(self, r: int) -> bool:
        """One reference to record ``r``'s CPU slot goes; True if it was the last (the slot
        is unregistered: an orphan if reads are pending)."""
        cpu = self.cpu
        block = cpu.slot_of[r]
        if cpu.unref(r) > 1:
            return False
        if cpu.pins[r]:
            self.orphans[block] = cpu.clear_pins(r)
        if self.gpu.slot_of[r] < 0:
            self._forget(r)
        return True

    def read_cpu(self, block: int) -> None:
        """A planned swap-in reads the registered CPU ``block`` for a chunk that leaves the
        CPU (its reference goes; the block is freed once read if it was the last). The last
        reference's read, with no other read pending, leaves the block as a private one read
        by a swap-in (freed at reclaim, nothing to count)."""
        cpu = self.cpu
        r = cpu.at[block]
        assert r >= 0
        if cpu.refs[r] == 1 and not cpu.pins[r]:
            self._unref_cpu(r)
            return
        cpu.pin_record(r)
        self.num_reads += 1
        self.step_reads.add(block)
        self._unref_cpu(r)

    def release_cpu(self, block: int) -> bool:
        """A chunk lets its CPU ``block`` go: False if other chunks still hold it (or a planned
        swap-in still reads it: then it is freed when reclaimed); True if the caller frees
        it."""
        r = self.cpu.at[block]
        if r < 0:
            return True
        return self._unref_cpu(r) and block not in self.orphans

    def end_reads(self, pool: BlockPool, blocks: list[int]) -> None:
        """A step starts; the swap-ins reading ``blocks`` are done: free the private ones, and
        the orphans whose last read this was (:attr:`step_reads` begins empty)."""
        self.step_reads.clear()
        if not self.num_reads:
            pool.free(blocks)
            return
        cpu, orphans = self.cpu, self.orphans
        at, reads = cpu.at, cpu.pins
        for b in blocks:
            r = at[b]
            if r >= 0 and reads[r]:
                cpu.unpin_record(r)
                self.num_reads -= 1
            elif b in orphans:
                self.num_reads -= 1
                if orphans[b] > 1:
                    orphans[b] -= 1
                else:
                    del orphans[b]
                    pool.free_one(b)
            else:
                pool.free_one(b)

    # ------------------------------------------------------------------ a turn's edges
    def find(self, req: Request, conv: Conversation, dropped: list[int], chunk_size: int,
             cpu_taken: Container[int] | None) -> Found:
        """Registered blocks the admitted turn can take instead of computing: ``found``,
        ``(index, GPU block)`` for its dropped full chunks; ``ext``, the GPU blocks of a
        conversation without KV's leading full chunks (up to the first miss); ``cpu``,
        ``(index, CPU block)`` for chunks of either kind registered on the CPU but not on the
        GPU (for a conversation without KV, those right after ``ext``, up to their first
        miss: indices past its chunks), to be swapped in. ``cpu_taken``: CPU slots not to be
        taken now (a background copy of this step writes them; None: no CPU tier). Only
        chunks wholly before the turn's last token (always computed) qualify. ``dropped``:
        the conversation's dropped chunks, ascending. Changes nothing but the registration
        another conversation owed under the turn's first hash (:meth:`ready_for`)."""
        chunks = conv.chunks
        if chunks and not dropped:  # KV and nothing dropped: nothing to take
            return [], [], []
        c = chunk_size
        limit = (req.num_tokens - 1) // c  # full chunks before the last token
        if self.alone and limit:
            self.ready_for(request_hashes(req, conv, c, 1)[0], conv)
        by_hash = self.by_hash
        if not by_hash:
            return [], [], []
        found: list[tuple[int, int]] = []
        ext: list[int] = []
        cpu: list[tuple[int, int]] = []
        reads, gpu_of, cpu_of = self.step_reads, self.gpu.slot_of, self.cpu.slot_of
        if not chunks and conv.kv_end == 0:
            hashes = request_hashes(req, conv, c, limit)
            for i in range(limit):
                r = by_hash.get(hashes[i])
                if r is None or gpu_of[r] < 0:
                    break
                ext.append(gpu_of[r])
            if cpu_taken is not None:
                for i in range(len(ext), limit):
                    r = by_hash.get(hashes[i])
                    cb = -1 if r is None else cpu_of[r]
                    if cb < 0 or cb in cpu_taken or cb in reads:
                        break
                    cpu.append((i, cb))
            return found, ext, cpu
        limit = min(limit, conv.kv_end // c)
        if dropped and dropped[-1] >= limit:
            dropped = [i for i in dropped if i < limit]
        if dropped:
            hashes = request_hashes(req, conv, c, dropped[-1] + 1)
            for i in dropped:
                r = by_hash.get(hashes[i])
                if r is None:
                    continue
                if gpu_of[r] >= 0:
                    found.append((i, gpu_of[r]))
                elif cpu_taken is not None and (cb := cpu_of[r]) >= 0 and cb not in cpu_taken \
                        and cb not in reads:
                    cpu.append((i, cb))
        return found, ext, cpu

    def pinned_by_others(self, chunks: list[Chunk], tiers: list[Tier],
                         found: list[tuple[int, int]], ext: list[int]) -> int:
        """Of the GPU blocks a turn being admitted would pin (its idle conversation's GPU
        chunks' (``tiers``: theirs), and the registered ones :meth:`find` found), how many
        running conversations pin already (they are not among the evictable blocks). The
        conversation's own blocks can be pinned by others only if shared: while no slot has
        two holders (the usual case without common prefixes) they are not looked up."""
        pinned = self.gpu.is_pinned
        n = sum(1 for b in ext if pinned(b)) + sum(1 for _, b in found if pinned(b))
        if self.gpu.shared:
            gpu = Tier.GPU
            n += sum(1 for ch, t in zip(chunks, tiers) if t is gpu and pinned(ch.block))
        return n

    def take(self, conv: Conversation, found: list[tuple[int, int]], ext: list[int],
             cpu: list[tuple[int, int]], chunk_size: int) -> int:
        """Make the chunks :meth:`find` found references to their slots (CPU chunks for
        ``cpu``: the turn swaps them in); returns the tokens of those on the GPU."""
        chunks, at, ref = conv.chunks, self.gpu.at, self.gpu.ref
        n = len(chunks)
        for i, b in found:
            chunks[i].tier, chunks[i].block = Tier.GPU, b
            ref(at[b])
        for b in ext:
            chunks.append(Chunk(Tier.GPU, b))
            ref(at[b])
        for i, b in cpu:
            if i < n:
                chunks[i].tier, chunks[i].block = Tier.CPU, b
            else:
                chunks.append(Chunk(Tier.CPU, b))
            self.ref_cpu(b)
        if len(chunks) > n:
            conv.kv_end = len(chunks) * chunk_size
        return (len(found) + len(ext)) * chunk_size

    def register_turn(self, req: Request, conv: Conversation, chunk_size: int) -> list[int]:
        """The turn ended (its conversation is idle, its history set): register its full GPU
        chunks within the history that are not registered yet, or owe their registration.

        Lazily: chained hashes mean a chunk can be shared only by a turn whose first chunk has
        the same hash. While no other conversation has had the conversation's first hash, it
        only owes its registration (:attr:`alone`): nothing is written per chunk, and the
        registration is made, as it would stand then, by :meth:`pay` once another turn looks
        that first hash up (:meth:`ready_for`, from :meth:`find` and the disk tier's lookups)
        or another conversation's turn ends with it. Otherwise eagerly: those past
        ``Conversation.share_upto`` and those its admissions brought back to the GPU,
        ``share_back``: work in proportion to what the turn changed), and keep their hashes
        on the conversation. Returns the GPU blocks to free: a chunk whose hash has a GPU slot
        already (computed by a turn beside this one) takes a reference to it instead (its
        chunk holds that block from then on)."""
        c = chunk_size
        n = min(conv.kv_end, len(conv.token_ids)) // c
        hashes = request_hashes(req, conv, c, n)
        if n and hashes[0] not in self.crowded:
            owner = self.alone.get(hashes[0])
            if owner is None or owner is conv:  # alone with its first hash: owed, lazily
                self.forget(conv)
                self.alone[hashes[0]] = conv
                self.owed[conv] = hashes[0]
                conv.share_back = []
                conv.share_hashes, conv.share_salt = hashes, req.share_salt
                conv.share_upto = max(conv.share_upto, n)
                return []
            self.crowded.add(hashes[0])
            self.pay(owner)
        self.pay(conv)  # what it owed under its first hash, before this turn's chunks
        gpu = self.gpu
        at, gpu_of, record = gpu.at, gpu.slot_of, self._record
        back, conv.share_back = conv.share_back, []
        new = range(min(conv.share_upto, n), n)
        chunks, gpu_tier = conv.chunks, Tier.GPU
        freed: list[int] = []
        for i in [*back, *new] if back else new:
            if i >= n:
                continue
            ch = chunks[i]
            b = ch.block
            if ch.tier is not gpu_tier or at[b] >= 0:
                continue
            r = record(hashes[i])
            if gpu_of[r] >= 0:  # computed beside this turn: its block is private, written
                gpu.ref(r)
                freed.append(b)
                ch.block = gpu_of[r]
            else:
                gpu.store(b, r)
        conv.share_hashes, conv.share_salt = hashes, req.share_salt
        conv.share_upto = max(conv.share_upto, n)
        return freed
