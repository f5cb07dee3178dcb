"""The block map: one record per shared block, across the GPU and CPU tiers.

A full chunk is named by its content hash (:func:`pensieve.core.prefix_share.extend_hashes`:
chained from its parent's and salted by tenant and ``cache_salt``). When prefixes are shared,
every full chunk whose KV is final is *registered*: its hash has one :class:`Block` record,
which says where that content lives (a GPU slot, a CPU slot, or both at once), how many
chunks hold each slot (its references), how many running turns pin its GPU slot, and how many
planned swap-ins still read its CPU slot. Conversations' chunks hold slots; nothing else keeps
that state::

    by_hash: {hash -> Block(hash, gpu=12, cpu=-1, gpu_refs=3, cpu_refs=0, pins=1, reads=0)}
    at_gpu:  [..., Block@12, ...]      at_cpu: [..., None, ...]      (slot -> its record)
    shared_gpu: {12}                   shared_cpu: {}                (slots held twice or more)

Which chunks share (``TieredKVCache``, :class:`~pensieve.core.kv_store.KVStore`). An ended
turn registers its full GPU chunks (:meth:`BlockMap.register_turn`); admission makes a turn's
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

The eviction index (:mod:`pensieve.core.eviction_index`) reads :attr:`BlockMap.shared_gpu`
and :attr:`BlockMap.shared_cpu`: a chunk whose slot others hold too is no eviction
candidate (its block is worth what all its sharers would lose).

Invariants (:meth:`BlockMap.check_gpu`, :meth:`BlockMap.check_cpu`): each record in
``by_hash`` has a slot, and ``at_gpu``/``at_cpu`` point back at it; each slot's references
equal the chunks holding it; ``shared_*`` is the set of slots with two references or more;
pins equal the running conversations holding the slot; reads equal the slot's pending
reclaims; the counters equal their sums.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Sequence
from dataclasses import dataclass

from pensieve.core.block_pool import BlockPool
from pensieve.core.conversation import Chunk, Conversation, Tier
from pensieve.core.prefix_share import extend_hashes
from pensieve.core.request import Request


@dataclass(slots=True, eq=False)
class Block:
    """One registered block: its content hash and, per tier, its slot and holders. Written
    only by :class:`BlockMap`."""

    hash: bytes
    gpu: int = -1
    """Its GPU slot (-1: none)."""
    cpu: int = -1
    """Its CPU slot (-1: none)."""
    gpu_refs: int = 0
    """Chunks holding the GPU slot."""
    cpu_refs: int = 0
    """Chunks holding the CPU slot."""
    pins: int = 0
    """Running conversations holding the GPU slot."""
    reads: int = 0
    """Planned swap-ins reading the CPU slot, not reclaimed yet."""


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

    __slots__ = ("by_hash",)

    def __init__(self, by_hash: dict[bytes, Block]) -> None:
        self.by_hash = by_hash

    def __contains__(self, h: object) -> bool:
        rec = self.by_hash.get(h)  # type: ignore[call-overload]
        return rec is not None and rec.gpu >= 0


class BlockMap:
    """Every registered block's record by hash, and each tier's slots' records (module
    docstring). Pure bookkeeping: the store allocates and frees the slots."""

    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.by_hash: dict[bytes, Block] = {}
        self.at_gpu: list[Block | None] = [None] * num_gpu_blocks
        self.at_cpu: list[Block | None] = [None] * num_cpu_blocks
        self.shared_gpu: set[int] = set()
        """GPU slots two or more chunks hold (no eviction candidates)."""
        self.shared_cpu: set[int] = set()
        """CPU slots two or more chunks hold."""
        self.num_gpu = self.num_cpu = 0
        """Records with a GPU (CPU) slot."""
        self.gpu_refs = self.cpu_refs = 0
        """Chunks holding a registered GPU (CPU) slot."""
        self.num_pinned = 0
        """Records whose GPU slot a running conversation pins."""
        self.num_reads = 0
        """Pending reads of registered and orphaned CPU slots."""
        self.orphans: dict[int, int] = {}
        """CPU slots no chunk holds any more -> their pending reads (freed at the last)."""
        self.step_reads: set[int] = set()
        """Registered CPU slots this step's swap-ins read: a step reads a CPU block once (the
        runner's copy batches cut disjoint runs), so admission takes none of these."""
        self.on_gpu = OnGpu(self.by_hash)
        self._spare: list[Block] = []
        """Records out of the map, reused: a step registers and unregisters many blocks, and
        allocating a record each time would set off the garbage collector's passes over
        everything the cache holds (they cost more than the bookkeeping itself)."""

    def _record(self, h: bytes) -> Block:
        """The record of hash ``h``, new (from the spare ones) if it has none."""
        rec = self.by_hash.get(h)
        if rec is None:
            if self._spare:
                rec = self._spare.pop()
                rec.hash = h
            else:
                rec = Block(h)
            self.by_hash[h] = rec
        return rec

    def _forget(self, rec: Block) -> None:
        """``rec`` has no slot left: out of the map, kept for reuse (its counts are 0)."""
        del self.by_hash[rec.hash]
        self._spare.append(rec)

    # ------------------------------------------------------------------ the GPU tier
    def gpu_block(self, h: bytes) -> int:
        """The GPU slot of hash ``h``, or -1."""
        rec = self.by_hash.get(h)
        return -1 if rec is None else rec.gpu

    def gpu_refs_of(self, block: int) -> int:
        """Chunks holding the GPU ``block`` if registered (0: unregistered)."""
        rec = self.at_gpu[block]
        return 0 if rec is None else rec.gpu_refs

    def is_pinned(self, block: int) -> bool:
        """A running conversation pins the registered GPU ``block``."""
        rec = self.at_gpu[block]
        return rec is not None and rec.pins > 0

    def _ref_gpu(self, rec: Block) -> None:
        rec.gpu_refs += 1
        self.gpu_refs += 1
        if rec.gpu_refs == 2:
            self.shared_gpu.add(rec.gpu)

    def leave_gpu(self, block: int) -> tuple[int, bytes]:
        """A chunk lets the registered GPU ``block`` go: its references before, and its hash.
        The last reference unregisters the slot (the caller keeps or frees the block)."""
        rec = self.at_gpu[block]
        assert rec is not None
        n = rec.gpu_refs
        rec.gpu_refs = n - 1
        self.gpu_refs -= 1
        if n == 2:
            self.shared_gpu.discard(block)
        elif n == 1:
            self.at_gpu[block] = None
            rec.gpu = -1
            self.num_gpu -= 1
            if rec.pins:
                rec.pins = 0
                self.num_pinned -= 1
            if rec.cpu < 0:
                self._forget(rec)
        return n, rec.hash

    def unref_gpu(self, block: int) -> bool:
        """A chunk lets GPU ``block`` go; True when the block itself must leave (private, or
        this was its last reference: it is unregistered)."""
        return self.at_gpu[block] is None or self.leave_gpu(block)[0] == 1

    def make_private(self, block: int) -> bool:
        """The chunk holding GPU ``block`` is to be written (it became partial): unregister the
        block if that chunk is its only holder; False if others hold it (the chunk must let it
        go instead)."""
        rec = self.at_gpu[block]
        if rec is None:
            return True
        return rec.gpu_refs == 1 and self.unref_gpu(block)

    def pin_gpu(self, blocks: Sequence[int]) -> int:
        """A conversation whose turn starts pins these registered GPU ``blocks``; returns how
        many other running conversations pinned already."""
        at, already = self.at_gpu, 0
        for b in blocks:
            rec = at[b]
            assert rec is not None
            if rec.pins:
                already += 1
            else:
                self.num_pinned += 1
            rec.pins += 1
        return already

    def unpin_gpu(self, blocks: Sequence[int]) -> int:
        """A running conversation that pinned these GPU ``blocks`` stops running: each loses
        a pin; returns how many are no longer pinned by anyone."""
        at, unpinned = self.at_gpu, 0
        for b in blocks:
            rec = at[b]
            if rec is None or not rec.pins:
                unpinned += 1
            elif rec.pins > 1:
                rec.pins -= 1
            else:
                rec.pins = 0
                self.num_pinned -= 1
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
                self.unref_gpu(ch.block)
                ch.tier, ch.block = Tier.DROPPED, -1

    # ------------------------------------------------------------------ the CPU tier
    def cpu_block(self, h: bytes) -> int:
        """The CPU slot of hash ``h``, or -1."""
        rec = self.by_hash.get(h)
        return -1 if rec is None else rec.cpu

    def cpu_refs_of(self, block: int) -> int:
        """Chunks holding the CPU ``block`` if registered (0: unregistered)."""
        rec = self.at_cpu[block]
        return 0 if rec is None else rec.cpu_refs

    def ref_cpu(self, block: int) -> None:
        """One more chunk holds the registered CPU ``block``."""
        rec = self.at_cpu[block]
        assert rec is not None
        rec.cpu_refs += 1
        self.cpu_refs += 1
        if rec.cpu_refs == 2:
            self.shared_cpu.add(block)

    def register_cpu(self, block: int, h: bytes) -> None:
        """The chunk holding the private CPU ``block`` of hash ``h`` (no CPU slot yet)
        registers it."""
        rec = self._record(h)
        rec.cpu, rec.cpu_refs = block, 1
        self.at_cpu[block] = rec
        self.num_cpu += 1
        self.cpu_refs += 1

    def move_to_cpu(self, rec: Block, block: int) -> None:
        """The one holder of ``rec``'s GPU slot (``rec`` has no CPU slot) moves to the CPU
        ``block``: the record keeps its place in the map, its slot changes tier."""
        self.at_gpu[rec.gpu] = None
        rec.gpu, rec.gpu_refs = -1, 0
        self.num_gpu -= 1
        self.gpu_refs -= 1
        rec.cpu, rec.cpu_refs = block, 1
        self.at_cpu[block] = rec
        self.num_cpu += 1
        self.cpu_refs += 1

    def _unref_cpu(self, rec: Block) -> bool:
        """One reference to ``rec``'s CPU slot goes; True if it was the last (the slot is
        unregistered: an orphan if reads are pending)."""
        block, n = rec.cpu, rec.cpu_refs
        rec.cpu_refs = n - 1
        self.cpu_refs -= 1
        if n == 2:
            self.shared_cpu.discard(block)
        if n > 1:
            return False
        self.at_cpu[block] = None
        rec.cpu = -1
        self.num_cpu -= 1
        if rec.reads:
            self.orphans[block], rec.reads = rec.reads, 0
        if rec.gpu < 0:
            self._forget(rec)
        return True

    def read_cpu(self, block: int) -> None:
        """A planned swap-in reads the registered CPU ``block`` for a chunk that leaves the
        CPU (its reference goes; the block is freed once read if it was the last). The last
        reference's read, with no other read pending, leaves the block as a private one read
        by a swap-in (freed at reclaim, nothing to count)."""
        rec = self.at_cpu[block]
        assert rec is not None
        if rec.cpu_refs == 1 and not rec.reads:
            self._unref_cpu(rec)
            return
        rec.reads += 1
        self.num_reads += 1
        self.step_reads.add(block)
        self._unref_cpu(rec)

    def release_cpu(self, block: int) -> bool:
        """A chunk lets its CPU ``block`` go: False if other chunks still hold it (or a planned
        swap-in still reads it: then it is freed when reclaimed); True if the caller frees
        it."""
        rec = self.at_cpu[block]
        if rec is None:
            return True
        return self._unref_cpu(rec) and block not in self.orphans

    def end_reads(self, pool: BlockPool, blocks: list[int]) -> None:
        """A step starts; the swap-ins reading ``blocks`` are done: free the private ones, and
        the orphans whose last read this was (:attr:`step_reads` begins empty)."""
        self.step_reads.clear()
        if not self.num_reads:
            pool.free(blocks)
            return
        at, orphans = self.at_cpu, self.orphans
        for b in blocks:
            rec = at[b]
            if rec is not None and rec.reads:
                rec.reads -= 1
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
        the conversation's dropped chunks, ascending. Changes nothing."""
        by_hash = self.by_hash
        if not by_hash:
            return [], [], []
        chunks = conv.chunks
        if chunks and not dropped:  # KV and nothing dropped: nothing to take
            return [], [], []
        c = chunk_size
        limit = (req.num_tokens - 1) // c  # full chunks before the last token
        found: list[tuple[int, int]] = []
        ext: list[int] = []
        cpu: list[tuple[int, int]] = []
        reads = self.step_reads
        if not chunks and conv.kv_end == 0:
            hashes = request_hashes(req, conv, c, limit)
            for i in range(limit):
                rec = by_hash.get(hashes[i])
                if rec is None or rec.gpu < 0:
                    break
                ext.append(rec.gpu)
            if cpu_taken is not None:
                for i in range(len(ext), limit):
                    rec = by_hash.get(hashes[i])
                    if rec is None or rec.cpu < 0 or rec.cpu in cpu_taken or rec.cpu in reads:
                        break
                    cpu.append((i, rec.cpu))
            return found, ext, cpu
        limit = min(limit, conv.kv_end // c)
        if dropped and dropped[-1] >= limit:
            dropped = [i for i in dropped if i < limit]
        if dropped:
            hashes = request_hashes(req, conv, c, dropped[-1] + 1)
            for i in dropped:
                rec = by_hash.get(hashes[i])
                if rec is None:
                    continue
                if rec.gpu >= 0:
                    found.append((i, rec.gpu))
                elif cpu_taken is not None and rec.cpu >= 0 and rec.cpu not in cpu_taken \
                        and rec.cpu not in reads:
                    cpu.append((i, rec.cpu))
        return found, ext, cpu

    def pinned_by_others(self, chunks: list[Chunk], tiers: list[Tier],
                         found: list[tuple[int, int]], ext: list[int]) -> int:
        """Of the GPU blocks a turn being admitted would pin (its idle conversation's GPU
        chunks' (``tiers``: theirs), and the registered ones :meth:`find` found), how many
        running conversations pin already (they are not among the evictable blocks). The
        conversation's own blocks can be pinned by others only if shared: while no slot has
        two holders (the usual case without common prefixes) they are not looked up."""
        pinned = self.is_pinned
        n = sum(1 for b in ext if pinned(b)) + sum(1 for _, b in found if pinned(b))
        if self.shared_gpu:
            gpu = Tier.GPU
            n += sum(1 for ch, t in zip(chunks, tiers) if t is gpu and pinned(ch.block))
        return n

    def take(self, conv: Conversation, found: list[tuple[int, int]], ext: list[int],
             cpu: list[tuple[int, int]], chunk_size: int) -> int:
        """Make the chunks :meth:`find` found references to their slots (CPU chunks for
        ``cpu``: the turn swaps them in); returns the tokens of those on the GPU."""
        chunks, at = conv.chunks, self.at_gpu
        n = len(chunks)
        for i, b in found:
            chunks[i].tier, chunks[i].block = Tier.GPU, b
            self._ref_gpu(at[b])  # type: ignore[arg-type]
        for b in ext:
            chunks.append(Chunk(Tier.GPU, b))
            self._ref_gpu(at[b])  # type: ignore[arg-type]
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
        chunks within the history that are not registered yet (those past
        ``Conversation.share_upto`` and those its admissions brought back to the GPU,
        ``share_back``: work in proportion to what the turn changed), and keep their hashes
        on the conversation. Returns the GPU blocks to free: a chunk whose hash has a GPU slot
        already (computed by a turn beside this one) takes a reference to it instead (its
        chunk holds that block from then on)."""
        c = chunk_size
        n = min(conv.kv_end, len(conv.token_ids)) // c
        hashes = request_hashes(req, conv, c, n)
        at, record = self.at_gpu, self._record
        back, conv.share_back = conv.share_back, []
        new = range(min(conv.share_upto, n), n)
        chunks, gpu_tier = conv.chunks, Tier.GPU
        freed: list[int] = []
        registered = 0
        for i in [*back, *new] if back else new:
            if i >= n:
                continue
            ch = chunks[i]
            b = ch.block
            if ch.tier is not gpu_tier or at[b] is not None:
                continue
            rec = record(hashes[i])
            if rec.gpu >= 0:  # computed beside this turn: its block is private, written
                self._ref_gpu(rec)
                freed.append(b)
                ch.block = rec.gpu
            else:
                rec.gpu, rec.gpu_refs = b, 1
                at[b] = rec
                registered += 1
        self.num_gpu += registered
        self.gpu_refs += registered
        conv.share_hashes, conv.share_salt = hashes, req.share_salt
        conv.share_upto = max(conv.share_upto, n)
        return freed

    # ------------------------------------------------------------------ audit
    def check_gpu(self, holders: dict[int, int], running_holders: dict[int, int]) -> None:
        """Raise AssertionError unless the GPU slots agree with ``holders`` (GPU block ->
        chunks holding it) and ``running_holders`` (-> running conversations holding it)."""
        self._check_records()
        recs = [rec for rec in self.at_gpu if rec is not None]
        assert len(recs) == self.num_gpu, "GPU record count"
        assert self.gpu_refs == sum(rec.gpu_refs for rec in recs), "GPU refs total"
        assert self.shared_gpu == {rec.gpu for rec in recs if rec.gpu_refs > 1}, "shared GPU"
        for b, n in holders.items():
            assert n == (self.gpu_refs_of(b) or 1), f"GPU block {b}: {n} holders"
        for rec in recs:
            b = rec.gpu
            assert self.at_gpu[b] is rec and b in holders, f"GPU block {b} record"
            assert rec.pins == running_holders.get(b, 0), f"GPU block {b}: pins {rec.pins}"
        assert self.num_pinned == sum(1 for rec in recs if rec.pins), "pinned count"

    def check_cpu(self, holders: Counter[int], reclaim: list[int]) -> None:
        """Raise AssertionError unless the CPU slots agree with ``holders`` (CPU block ->
        chunks holding it) and ``reclaim`` (the CPU blocks swap-ins read, pending)."""
        at = self.at_cpu
        recs = [rec for rec in at if rec is not None]
        assert len(recs) == self.num_cpu, "CPU record count"
        assert self.cpu_refs == sum(rec.cpu_refs for rec in recs), "CPU refs total"
        assert self.shared_cpu == {rec.cpu for rec in recs if rec.cpu_refs > 1}, "shared CPU"
        for b, n in holders.items():
            assert n == (self.cpu_refs_of(b) or 1), f"CPU block {b}: {n} holders"
        for rec in recs:
            assert at[rec.cpu] is rec and rec.cpu in holders, f"CPU block {rec.cpu} record"
        pending = Counter(reclaim)
        reads = 0
        for b, n in pending.items():
            read = at[b]
            if read is not None and read.reads:
                assert read.reads == n, f"CPU block {b}: reads {read.reads}, reclaims {n}"
                reads += n
            elif b in self.orphans:
                assert self.orphans[b] == n and b not in holders, f"orphan {b}"
                reads += n
            else:
                assert n == 1 and b not in holders, f"CPU block {b} reclaim clash"
        assert reads == self.num_reads, f"pending reads {self.num_reads} != {reads}"
        assert all(b in pending for b in self.orphans), "an orphan with no reclaim"

    def _check_records(self) -> None:
        for h, rec in self.by_hash.items():
            assert rec.hash == h and (rec.gpu >= 0 or rec.cpu >= 0), f"record {h.hex()}"
            assert rec.gpu < 0 or self.at_gpu[rec.gpu] is rec, f"record {h.hex()}: GPU slot"
            assert rec.cpu < 0 or self.at_cpu[rec.cpu] is rec, f"record {h.hex()}: CPU slot"
            assert rec.cpu >= 0 or not rec.reads, f"record {h.hex()}: reads, no CPU slot"
