"""The KV store: every block's one owner. The GPU and CPU block pools, the block map of
shared blocks (:mod:`pensieve.core.block_map`), the disk tier's index, each step's copy plan,
and the eviction passes that fill it.

Block life cycle, and why reclaiming is lazy. A GPU block sent to the CPU ahead of time
(``SwapPlan.swap_out``, a *background* swap-out) stays taken until the runner reports its copy
done: each step's background swap-outs form one *reclaim group*, groups wait in a FIFO, and
:meth:`TieredKVCache.reclaim_swap_outs` (called by the scheduler with
``RunnerOutput.swap_outs_in_flight``) frees the oldest groups until only that many remain.
A CPU block whose chunk was swapped in stays taken until the next step (a swap-out planned in
the same step must not overwrite it before it is read). Urgent evictions (``swap_out_first``)
free their GPU block at once: the runner copies them before the step touches any KV.

Eviction passes take idle chunks in the order of the
:class:`~pensieve.core.eviction_index.EvictionIndex` the store holds (the cache's, shared):
a GPU chunk goes to a free CPU block, or to one freed by dropping the CPU tier's lowest chunk
if that one's key is lower, else it is dropped. An eviction pass and a suspension's moves take
that one path (:meth:`KVStore._leave_gpu`); the store keeps the index right as chunks move.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pensieve.core.block_map import BlockMap
from pensieve.core.block_pool import BlockPool
from pensieve.core.conversation import Chunk, Conversation, Tier
from pensieve.core.disk_index import DiskIndex, spill_chunk
from pensieve.core.eviction import EvictionKey
from pensieve.core.eviction_index import EvictionIndex
from pensieve.core.outputs import SwapPlan
from pensieve.core.pool_audit import check_pool
from pensieve.core.shared_eviction import SharedOrder, lowest_shared
from pensieve.core.stats import CacheStats
from pensieve.core.swap_reads import SwapInReads
from pensieve.core.tenant_share import TenantShare


@dataclass
class _StepPlan:
    swap_out_first: dict[int, int] = field(default_factory=dict)
    """cpu_block -> gpu_block of urgent swap-outs, in plan order."""
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swap_in_ahead: list[tuple[int, int]] = field(default_factory=list)
    swap_out: dict[int, int] = field(default_factory=dict)
    """cpu_block -> gpu_block of background swap-outs, in plan order."""


class KVStore:
    """Every block's owner: the GPU and CPU block pools, the block map of shared blocks, the
    disk tier's index, the step's copy plan, the background swap-outs awaiting reclaim, and
    the eviction passes (victims from the :class:`EvictionIndex` it holds)."""

    def __init__(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        index: EvictionIndex,
        swap_out_threshold: float,
        decode_reserve: float,
        swap_out_batch: float,
        tenant_kv_share: float | None,
        blocks: BlockMap | None,
        disk: DiskIndex | None,
    ) -> None:
        """``index``: the eviction index over the same conversations (shared with the
        cache). No CPU pool when the index's policy keeps no CPU tier or ``num_cpu_blocks`` is
        0. ``tenant_kv_share``: see :class:`~pensieve.core.tenant_share.TenantShare`.
        ``blocks``: the block map of shared blocks (the index's too; None: prefixes are not
        shared). ``disk``: the disk tier's index (None: none)."""
        if not 0.0 <= swap_out_threshold < 1.0 or not 0.0 <= decode_reserve < 1.0:
            raise ValueError("swap_out_threshold and decode_reserve must be in [0, 1)")
        self.index = index
        self.chunk_size = index.chunk_size
        self.gpu = BlockPool(num_gpu_blocks)
        self.cpu: BlockPool | None = (
            BlockPool(num_cpu_blocks) if index.policy.uses_cpu_tier and num_cpu_blocks > 0
            else None
        )
        self.swap_out_threshold_blocks = int(swap_out_threshold * num_gpu_blocks)
        self.swap_out_batch_blocks = int(swap_out_batch * num_gpu_blocks)
        """Once under the threshold, free this many blocks beyond it: swaps go in batches
        (longer copies, one eviction pass per batch instead of one per step)."""
        self.decode_reserve_blocks = int(decode_reserve * num_gpu_blocks)
        self.stats = CacheStats()
        self.tenant_share: TenantShare | None = None if tenant_kv_share is None else (
            TenantShare(tenant_kv_share, num_gpu_blocks, self.cpu.num_blocks if self.cpu else 0))
        self.disk = disk
        """The disk tier below the CPU tier (:mod:`pensieve.core.disk_index`); None: none."""
        self._hints_due: set[Conversation] = set()
        """Conversations whose tenant crossed its share in an eviction, re-keyed once the
        eviction's run is over (a run holds its victim at the top of the GPU heap)."""
        self._reclaim_groups: deque[list[int]] = deque()
        """GPU blocks of each earlier step's background swap-outs, oldest first."""
        self._reclaim_group_blocks = 0
        self._plan = _StepPlan()
        self.pinned_gpu = 0
        """GPU blocks held by running conversations (all of their chunks; a shared block
        once)."""
        self.blocks = blocks
        """One record per shared block, in both tiers (:mod:`pensieve.core.block_map`);
        None: prefixes are not shared."""
        self.share_cpu = blocks is not None and self.cpu is not None
        """Shared blocks are held once in the CPU tier too."""
        self.reads = SwapInReads(self.cpu, blocks if self.share_cpu else None)
        """The CPU blocks swap-ins read, freed once read."""
        self.shared_order = SharedOrder.pair(index, blocks, self.share_cpu)
        """The GPU and CPU tiers' shared blocks by their sharers' combined key (None: none)."""

    @property
    def has_pending_swap_outs(self) -> bool:
        """Background swap-outs whose GPU blocks are not reclaimed yet (copies may run)."""
        return bool(self._reclaim_groups)

    # ------------------------------------------------------------------ the step's plan
    def begin_step(self) -> None:
        """Free the CPU blocks whose chunks the previous step swapped in (those it swapped in
        ahead: at the next step)."""
        self.reads.begin_step()

    @property
    def num_planned_swap_ins(self) -> int:
        """Chunks this step's plan swaps in so far (``SwapPlan.swap_in``)."""
        return len(self._plan.swap_in)

    def swap_in_ahead(self, since: int) -> int:
        """Move the swap-ins planned after the first ``since`` to ``SwapPlan.swap_in_ahead``;
        returns how many."""
        plan = self._plan
        moved = plan.swap_in[since:]
        if not moved:
            return 0
        del plan.swap_in[since:]
        plan.swap_in_ahead.extend(moved)
        self.reads.move_ahead([c for c, _ in moved])
        return len(moved)

    def queued_copies(self) -> int:
        """Chunk copies on the copy stream this step so far: urgent swap-outs and swap-ins
        planned, and background swap-outs still in flight as last reported."""
        p = self._plan
        return (len(p.swap_out_first) + len(p.swap_in) + len(p.swap_in_ahead)
                + self._reclaim_group_blocks)

    def take_swap_plan(self) -> SwapPlan:
        """This step's copies; its background swap-outs become a reclaim group."""
        p, self._plan = self._plan, _StepPlan()
        out = [(g, c) for c, g in p.swap_out.items()]
        if out:
            self._reclaim_groups.append([g for g, _ in out])
            self._reclaim_group_blocks += len(out)
        return SwapPlan([(g, c) for c, g in p.swap_out_first.items()], p.swap_in, out,
                        p.swap_in_ahead)

    def reclaim_swap_outs(self, in_flight: int) -> None:
        """``in_flight`` background swap-out batches still copy (in plan order): free the rest."""
        if not 0 <= in_flight <= len(self._reclaim_groups):
            raise ValueError(f"{in_flight} swap-out batches reported in flight, "
                             f"{len(self._reclaim_groups)} were planned and not yet reclaimed")
        while len(self._reclaim_groups) > in_flight:
            group = self._reclaim_groups.popleft()
            self.gpu.free(group)
            self._reclaim_group_blocks -= len(group)

    @property
    def plan(self) -> _StepPlan:
        """This step's copy plan so far (read-only to others: :meth:`copy_out_now` adds)."""
        return self._plan

    def copy_out_now(self, gpu_block: int, cpu_block: int, tokens: int) -> None:
        """Plan an urgent copy of ``gpu_block`` (``tokens`` of KV) into ``cpu_block``, before
        the step's compute (``SwapPlan.swap_out_first``); the GPU block's holders decide
        whether it is freed (a shared block's copy keeps it: ``to_cpu_copy``)."""
        self._plan.swap_out_first[cpu_block] = gpu_block
        self.stats.swapped_out_tokens += tokens

    def pending_reclaim_gpu(self) -> int:
        """GPU blocks that become free once background copies finish."""
        return self._reclaim_group_blocks + len(self._plan.swap_out)

    # ------------------------------------------------------------------ running conversations
    def pin(self, conv: Conversation) -> tuple[int, int, int]:
        """Bring every chunk of a conversation whose turn starts to the GPU (CPU chunks by a
        planned swap-in, dropped ones into fresh blocks to be recomputed) and count its blocks
        as pinned; sets its block table. Returns its tokens (already on the GPU, swapped in,
        to recompute). The GPU must have a free block for each chunk not on it."""
        c = self.chunk_size
        chunks = conv.chunks
        gpu, swap_in, reclaim_cpu = self.gpu, self._plan.swap_in, []
        kv_end, gpu_tier, cpu_tier = conv.kv_end, Tier.GPU, Tier.CPU
        table: list[int] = []
        hit = swapped = recomputed = 0
        blocks = self.blocks
        at_gpu = blocks.gpu.at if blocks is not None else ()
        at_cpu = blocks.cpu.at if blocks is not None and self.share_cpu else ()  # -1: private
        registered = conv.pinned_shared
        for i, ch in enumerate(chunks):
            tokens = min(c, kv_end - i * c)  # > 0: an idle conversation has cdiv(kv_end, c)
            tier = ch.tier
            if tier is gpu_tier:
                hit += tokens
                if at_gpu and at_gpu[ch.block] >= 0:  # registered: pinned once
                    registered.append(ch.block)
            else:
                block = gpu.allocate_one()
                if blocks is not None and i < conv.share_upto:
                    conv.share_back.append(i)
                if tier is cpu_tier:
                    if at_cpu and at_cpu[ch.block] >= 0:  # a read, no reference
                        blocks.read_cpu(ch.block)  # type: ignore[union-attr]
                    swap_in.append((ch.block, block))
                    reclaim_cpu.append(ch.block)
                    swapped += tokens
                else:
                    recomputed += tokens
                ch.tier, ch.block = gpu_tier, block
            table.append(ch.block)
        if reclaim_cpu:
            self.reads.add(reclaim_cpu)
        conv.block_table = tuple(table)
        self.pinned_gpu += len(chunks)
        if registered and blocks is not None:  # pinned by others already: counted once
            self.pinned_gpu -= blocks.gpu.pin(registered)
        return hit, swapped, recomputed

    def extend(self, conv: Conversation, num_chunks: int) -> None:
        """``num_chunks`` more GPU chunks (free blocks, pinned) at a running conversation's end."""
        if num_chunks <= 0:
            return
        blocks = self.gpu.allocate(num_chunks)
        conv.chunks += [Chunk(Tier.GPU, b) for b in blocks]
        conv.block_table += tuple(blocks)
        self.pinned_gpu += num_chunks

    def release(self, conv: Conversation) -> None:
        """A running conversation stops running (its chunks are all on the GPU). Only the
        registered blocks :meth:`pin` recorded lose a pin (registration happens at the end of
        a turn, unregistration when the last reference, an idle one, leaves)."""
        blocks, registered = self.blocks, conv.pinned_shared
        if blocks is None or not registered:
            self.pinned_gpu -= len(conv.chunks)
        else:
            self.pinned_gpu -= (len(conv.chunks) - len(registered)
                                + blocks.gpu.unpin(registered))
            conv.pinned_shared = []
        conv.running = False
        conv.block_table = ()

    def free_chunks(self, conv: Conversation, keep: int) -> None:
        """Free the blocks of chunks ``keep..`` and forget those chunks (of an idle
        conversation, or one being released)."""
        for i in range(keep, len(conv.chunks)):
            ch = conv.chunks[i]
            if ch.tier is Tier.GPU:
                self.free_gpu_block(ch.block)
            elif ch.tier is Tier.CPU and self.cpu is not None:
                self._free_cpu_block(ch.block, conv.chunk_tokens(i, self.chunk_size))
        del conv.chunks[keep:]
        conv.kv_end = min(conv.kv_end, keep * self.chunk_size)
        conv.share_upto = min(conv.share_upto, keep)
        if self.blocks is not None:
            self.blocks.truncated(conv, self.chunk_size)

    def free_gpu_block(self, block: int) -> None:
        """An idle chunk lets its GPU ``block`` go: freed unless another chunk shares it."""
        if self.blocks is None or self.blocks.unref_gpu(block):
            self.gpu.free_one(block)

    # ------------------------------------------------------------------ eviction
    def evictable_gpu_blocks(self) -> int:
        """GPU blocks held by idle conversations (the others are pinned or to be reclaimed)."""
        taken = self.gpu.num_blocks - self.gpu.num_free_blocks - self.pending_reclaim_gpu()
        return taken - self.pinned_gpu

    def evict_gpu(self, n: int, now: float, urgent: bool) -> int:
        """Move (or drop) up to ``n`` idle GPU chunks, lowest key first; returns how many.

        The hot loop of the cache. The victim's chunks are taken in a run while the next one's
        key stays below every other entry of the GPU heap (the top's children bound all
        others from below, lower bounds included), so the heap is touched once per run, not
        once per chunk; the order is the one a pass chunk by chunk would take. A victim shared
        since it was indexed is passed over. An urgent pass takes a shared block whole when its
        sharers' combined key is the lowest (:class:`SharedOrder`), and, left with no
        candidate, the rest (:func:`lowest_shared`)."""
        idx = self.index
        idx.refresh(now)
        whole = idx.policy.whole_conversation
        gpu_index = idx.gpu
        step = idx.step
        gpu_tier = Tier.GPU
        peek_victim, first = idx.peek_victim, idx.first
        key_now = idx.key_now
        evict_chunk = self._evict_chunk
        # entries keyed now go on a list to be keyed at t_e again (time-dependent keys only)
        exact = idx.keyed_now if idx.time_dependent else []
        blocks = self.blocks
        shared = blocks.gpu.shared if blocks is not None else ()
        order = self.shared_order[0] if urgent and shared else None  # none shared: none
        done = 0
        last: Conversation | None = None
        while True:
            top = peek_victim(gpu_tier)
            s = order.top() if order is not None and done < n else None
            ranked = s is not None
            if top is None and s is None and done < n and urgent and blocks is not None \
                    and blocks.gpu.num:
                s = lowest_shared(idx, blocks, gpu_tier)  # only shared ones left: fallback
            if s is not None and (top is None or s[0] < top[0]):  # a shared block, whole
                if ranked and order is not None:
                    order.take()
                for hkey, holder, hi in s[2]:  # every holder lets it go, the last moves it
                    evict_chunk(holder, hi, hkey, urgent, True)
                done += 1
                if self._hints_due:
                    self.apply_hints()
                continue
            if top is None:
                break
            key, conv, i = top
            if done >= n and not (whole and conv is last):
                break
            heap = gpu_index.heap
            bound = (min(heap[1][1], heap[2][1]) if len(heap) > 2
                     else heap[1][1] if len(heap) == 2 else None)
            if s is not None and (bound is None or s[0] < bound):
                bound = s[0]  # the run stops where the shared block comes first
            chunks = conv.chunks
            while True:
                if shared and chunks[i].block in shared:
                    pass  # shared since it was indexed: no candidate (SharedOrder's)
                else:  # the block's one holder: it moves
                    evict_chunk(conv, i, key, urgent)
                    done += 1
                # the conversation's next GPU chunk takes its place in the GPU index
                j = first(conv, gpu_tier, i + step)
                if j is None:
                    gpu_index.pop_top(conv)
                    break
                i, key = j, key_now(conv, j)
                if (done >= n and not whole) or (bound is not None and not key < bound):
                    # keyed now (exact, for this eviction); at t_e again when time moves
                    gpu_index.replace_top(conv, j, key, now)
                    exact.append((gpu_index, conv))
                    break
            if self._hints_due:  # after the run: it holds conv at the top of the GPU heap
                self.apply_hints()
            last = conv
        return done

    def _evict_chunk(self, conv: Conversation, i: int, key: EvictionKey, urgent: bool,
                     move_shared: bool = False) -> Tier | None:
        """GPU chunk ``i`` of ``conv`` (of key ``key`` now) leaves in an eviction pass
        (:meth:`_leave_gpu`); its CPU index entry and its tenant's counts follow."""
        to = self._leave_gpu(conv, i, key, urgent, move_shared)
        if to is Tier.CPU:
            self.index.entered_cpu(conv, i, key)
        if self.tenant_share is not None and conv in self.tenant_share.counted:
            self._hints_due |= self.tenant_share.moved(conv, Tier.GPU, to or Tier.DROPPED)
        return to

    def move_out(self, conv: Conversation) -> None:
        """Every GPU chunk of an idle conversation (just suspended, indexed) leaves the GPU
        urgently, outside an eviction pass, at the index's ``now`` (the caller refreshes it):
        to the CPU where the tier has or can make room (:meth:`_leave_gpu`), else dropped; the
        conversation leaves the GPU index."""
        idx = self.index
        for i, ch in enumerate(conv.chunks):
            if ch.tier is Tier.GPU:
                to = self._leave_gpu(conv, i, None, urgent=True)
                if to is None and self.tenant_share is not None \
                        and conv in self.tenant_share.counted:
                    self._hints_due |= self.tenant_share.moved(conv, Tier.GPU, Tier.DROPPED)
                if self._hints_due:
                    self.apply_hints()
                if to is Tier.CPU:
                    idx.entered_cpu(conv, i)
        idx.gpu.discard(conv)

    def apply_hints(self, convs: set[Conversation] | None = None) -> None:
        """The policy reads each conversation's hints as its tenant's share allows
        (``convs``, else those whose tenant crossed its share since the last call)."""
        assert self.tenant_share is not None
        if convs is None:
            convs, self._hints_due = self._hints_due, set()
        self.tenant_share.apply(convs, self.index.rekey)

    def _leave_gpu(self, conv: Conversation, i: int, key: EvictionKey | None,
                   urgent: bool, move_shared: bool = False) -> Tier | None:
        """GPU chunk ``i`` of ``conv`` (of key ``key`` now; None: not computed yet) leaves for
        a free CPU block, or one freed by dropping the CPU tier's lowest chunk if that one's
        key is not higher, else it is dropped; returns the tier it went to. An urgent copy
        frees its GPU block at once, a background one when it is reclaimed. A block other
        chunks share stays: the chunk drops its reference (None: dropped), or goes to the
        block's CPU copy with ``move_shared`` (:meth:`_to_cpu_copy`). A registered block's
        last holder takes its record along (:meth:`BlockMap.move_to_cpu`). The caller keeps
        the conversation's index entries (of both tiers) right."""
        ch = conv.chunks[i]
        blocks = self.blocks
        h = b""
        along = blocks is not None and blocks.moves_alone(ch.block)  # its record goes along
        if blocks is not None and not along and blocks.gpu.at[ch.block] >= 0:
            b = ch.block
            n, h = blocks.leave_gpu(b)  # an idle chunk: not pinned
            if n > 1:
                if move_shared and self._to_cpu_copy(conv, i, h, key):
                    return Tier.CPU
                ch.tier, ch.block = Tier.DROPPED, -1
                return None
            if self.share_cpu and blocks.cpu.lookup(h) >= 0 \
                    and self._to_cpu_copy(conv, i, h, key):
                self.gpu.free_one(b)  # its copy is on the CPU already
                return Tier.CPU
        c = self.chunk_size
        tokens = min(c, conv.kv_end - i * c)  # > 0: an idle conversation has cdiv(kv_end, c)
        cpu, stats = self.cpu, self.stats
        cpu_block = -1
        if cpu is not None:
            if cpu.num_free_blocks:
                cpu_block = cpu.allocate_one()
            else:
                cpu_block = self.take_cpu_block(self.index.key_now(conv, i) if key is None
                                                else key)
        if cpu_block < 0:  # dropped from the GPU: to the disk tier, if it takes it
            if along:
                blocks.leave_gpu(ch.block)  # type: ignore[union-attr]  # its last holder
            to = Tier.DISK if self.disk is not None and self._spill_to_disk(conv, i) \
                else Tier.DROPPED
            self.gpu.free_one(ch.block)
            ch.tier, ch.block = to, -1
            stats.dropped_tokens += tokens
            return to
        gpu_block = ch.block
        if urgent:
            self._plan.swap_out_first[cpu_block] = gpu_block
            self.gpu.free_one(gpu_block)
        else:
            self._plan.swap_out[cpu_block] = gpu_block
        ch.tier, ch.block = Tier.CPU, cpu_block
        stats.swapped_out_tokens += tokens
        if along:
            blocks.move_to_cpu(gpu_block, cpu_block)  # type: ignore[union-attr]
        elif h and blocks is not None and blocks.cpu.lookup(h) < 0:
            blocks.register_cpu(cpu_block, h)
        return Tier.CPU

    def lookup_cpu(self, h: bytes) -> int:
        """The registered CPU block of hash ``h`` a chunk may take a reference to now, or -1
        (none, or one that a background copy of this step writes or a swap-in reads)."""
        blocks = self.blocks
        if blocks is None or not self.share_cpu:
            return -1
        b = blocks.cpu.lookup(h)
        return -1 if b in self._plan.swap_out or b in blocks.step_reads else b

    def _to_cpu_copy(self, conv: Conversation, i: int, h: bytes,
                     key: EvictionKey | None) -> bool:
        """GPU chunk ``i`` of an idle ``conv``, of hash ``h``, whose block stays on the GPU
        (other chunks hold it, or the caller frees it) takes a reference to the block's CPU
        copy, made now (an urgent copy, registered) if there is none; False if it cannot (no
        CPU block, or the copy is written in the background this step). The caller indexes
        it."""
        blocks = self.blocks
        if blocks is None or not self.share_cpu:
            return False
        ch = conv.chunks[i]
        cb = self.lookup_cpu(h)
        if cb >= 0:
            blocks.ref_cpu(cb)
        elif blocks.cpu.lookup(h) >= 0:  # its copy is written in the background this step
            return False
        else:
            cb = self.take_cpu_block(self.index.key_now(conv, i) if key is None else key)
            if cb < 0:
                return False
            # urgent: the GPU block stays held (not freed)
            self.copy_out_now(ch.block, cb, conv.chunk_tokens(i, self.chunk_size))
            blocks.register_cpu(cb, h)
        ch.tier, ch.block = Tier.CPU, cb
        return True

    def drop_read_twice(self, conv: Conversation) -> int:
        """The CPU chunks of ``conv`` (being admitted) whose block another swap-in of this
        step reads already are dropped, to be recomputed (:attr:`BlockMap.step_reads`);
        returns their tokens."""
        blocks = self.blocks
        if blocks is None or not self.share_cpu or not blocks.step_reads:
            return 0
        tokens = 0
        for i, ch in enumerate(conv.chunks):
            if ch.tier is Tier.CPU and ch.block in blocks.step_reads:
                tokens += conv.chunk_tokens(i, self.chunk_size)
                self.drop_cpu_chunk(conv, i)
        return tokens

    def take_cpu_block(self, key: EvictionKey | None, settle: bool = False) -> int:
        """A free CPU block, or one freed by dropping the CPU tier's lowest chunk or shared block
        (whole: :class:`SharedOrder`; to disk, when there is one) unless its key is higher than
        ``key`` (None: whatever its key); -1 if neither. Tenants' hints the drop changes are
        applied now with ``settle``, else by the caller."""
        cpu = self.cpu
        assert cpu is not None
        blocks = self.blocks if self.share_cpu else None
        order = self.shared_order[1] if blocks is not None and blocks.cpu.shared else None
        while not cpu.num_free_blocks:  # a drop may free no block (a read one): the next
            victim = self.index.peek_victim(Tier.CPU)
            s = order.top() if order is not None else None
            ranked = s is not None
            if victim is None and s is None and blocks is not None and blocks.cpu.num:
                s = lowest_shared(self.index, blocks, Tier.CPU)  # only shared ones: fallback
            if s is not None and (victim is None or s[0] < victim[0]):  # a shared block
                if key is not None and key < s[0]:
                    return -1
                if ranked and order is not None:
                    order.take()
                for _, holder, hi in s[2]:  # every holder lets it go, the last frees it
                    self.drop_cpu_victim(holder, hi)
                    self.index.reindex_cpu(holder)
            elif victim is None or (key is not None and key < victim[0]):
                return -1
            else:
                _, conv, i = victim
                if blocks is None or conv.chunks[i].block not in blocks.cpu.shared:
                    self.drop_cpu_victim(conv, i)  # (else shared since indexed)
                self.index.pass_top(self.index.cpu, Tier.CPU, conv, i)
            if settle and self._hints_due:
                self.apply_hints()
        return cpu.allocate_one()

    def drop_cpu_victim(self, conv: Conversation, i: int) -> None:
        """Drop an idle CPU chunk (the caller keeps the CPU index right)."""
        self.stats.dropped_tokens += conv.chunk_tokens(i, self.chunk_size)
        blocks = self.blocks if self.share_cpu else None
        on_disk = (self.disk is not None
                   and (blocks is None or blocks.cpu.refs_of(conv.chunks[i].block) < 2)
                   and self._spill_to_disk(conv, i))  # the block's last holder: to disk
        self.drop_cpu_chunk(conv, i)
        if on_disk:
            conv.chunks[i].tier = Tier.DISK
        if self.tenant_share is not None and conv in self.tenant_share.counted:
            self._hints_due |= self.tenant_share.moved(conv, Tier.CPU, Tier.DROPPED)

    def _spill_to_disk(self, conv: Conversation, i: int) -> bool:
        """Chunk ``i`` of an idle ``conv`` (on the CPU, or on the GPU) leaves the cache by the
        retention order: :func:`spill_chunk`, unless it is a CPU chunk still to be copied into
        its block in this step. Call it before the block is freed. True: the disk holds its
        copy for the conversation (the chunk goes to ``Tier.DISK``)."""
        assert self.disk is not None
        b = conv.chunks[i].block
        if conv.chunks[i].tier is Tier.GPU or not (b in self._plan.swap_out
                                                   or b in self._plan.swap_out_first):
            held = spill_chunk(self.disk, conv, i, self.chunk_size, self.index.key_now)
            self.stats.disk_written_tokens += held
            return held > 0
        return False

    def drop_cpu_chunk(self, conv: Conversation, i: int) -> None:
        """Chunk ``i`` leaves the CPU tier without a copy (its KV is to be recomputed). The
        caller keeps the index right."""
        assert self.cpu is not None
        ch = conv.chunks[i]
        self._free_cpu_block(ch.block, conv.chunk_tokens(i, self.chunk_size))
        ch.tier, ch.block = Tier.DROPPED, -1

    def _free_cpu_block(self, block: int, tokens: int) -> None:
        """A chunk lets its CPU ``block`` go (freed unless other chunks hold it or a planned
        swap-in still reads it: :meth:`BlockMap.release_cpu`)."""
        blocks = self.blocks if self.share_cpu else None
        if (blocks is None or blocks.release_cpu(block)) and self.cpu is not None:
            self._cancel_swap_out(block, tokens)
            self.cpu.free_one(block)

    def _cancel_swap_out(self, cpu_block: int, tokens: int) -> None:
        """Forget this step's copy into ``cpu_block``, if any (its chunk leaves the CPU tier
        before the copy is issued); a background one's GPU block is free at once."""
        gpu_block = self._plan.swap_out_first.pop(cpu_block, None)
        if gpu_block is None:
            gpu_block = self._plan.swap_out.pop(cpu_block, None)
            if gpu_block is None:
                return
            self.gpu.free([gpu_block])
        self.stats.swapped_out_tokens -= tokens

    # ------------------------------------------------------------------ audit
    def check(self) -> None:
        """Raise AssertionError if a block of either pool is free and held, held twice (unless
        shared), or neither (waiting to be reclaimed counts as held: the reclaim groups, and
        the CPU blocks swap-ins read), or the pending background swap-outs are off; and check
        the block map against the chunks holding its slots (:func:`check_pool`)."""
        gpu_reclaim = [b for g in self._reclaim_groups for b in g]
        pending = list(self._plan.swap_out.values())
        assert self.pending_reclaim_gpu() == len(gpu_reclaim) + len(pending), "reclaim count"
        convs, c = self.index.conversations.values(), self.chunk_size
        check_pool(self.gpu, Tier.GPU, gpu_reclaim + pending, convs, c, self.blocks)
        if self.cpu is not None:
            check_pool(self.cpu, Tier.CPU, self.reads.now + self.reads.ahead, convs, c,
                       self.blocks if self.share_cpu else None)
