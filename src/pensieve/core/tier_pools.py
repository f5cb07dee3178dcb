"""The two block pools, each step's copy plan, and the eviction passes that fill it.

Block life cycle, and why reclaiming is lazy. A GPU block sent to the CPU ahead of time
(``SwapPlan.swap_out``, a *background* swap-out) stays taken until the runner reports its copy
done: each step's background swap-outs form one *reclaim group*, groups wait in a FIFO, and
:meth:`TieredKVCache.reclaim_swap_outs` (called by the scheduler with
``RunnerOutput.swap_outs_in_flight``) frees the oldest groups until only that many remain.
A CPU block whose chunk was swapped in stays taken until the next step (a swap-out planned in
the same step must not overwrite it before it is read). Urgent evictions (``swap_out_first``)
free their GPU block at once: the runner copies them before the step touches any KV.

Eviction passes take idle chunks in the order of the
:class:`~pensieve.core.eviction_index.EvictionIndex` this class builds on: a GPU chunk goes to
a free CPU block, or to one freed by dropping the CPU tier's lowest chunk if that one's key is
lower, else it is dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pensieve.core.block_pool import BlockPool
from pensieve.core.conversation import Conversation, Tier
from pensieve.core.disk_index import DiskIndex
from pensieve.core.disk_restore import spill_to_disk
from pensieve.core.eviction import ChunkCost, EvictionKey, EvictionPolicy
from pensieve.core.eviction_index import EvictionIndex
from pensieve.core.outputs import SwapPlan
from pensieve.core.stats import CacheStats
from pensieve.core.tenant_share import TenantShare


@dataclass
class _StepPlan:
    swap_out_first: dict[int, int] = field(default_factory=dict)
    """cpu_block -> gpu_block of urgent swap-outs, in plan order."""
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swap_in_ahead: list[tuple[int, int]] = field(default_factory=list)
    swap_out: dict[int, int] = field(default_factory=dict)
    """cpu_block -> gpu_block of background swap-outs, in plan order."""


class TierPools(EvictionIndex):
    """GPU and CPU block pools, the step's copy plan and the background swap-outs awaiting
    reclaim."""

    def __init__(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        chunk_size: int,
        policy: EvictionPolicy,
        chunk_cost: ChunkCost,
        swap_out_threshold: float,
        decode_reserve: float,
        swap_out_batch: float,
        key_refresh_s: float,
    ) -> None:
        if not 0.0 <= swap_out_threshold < 1.0 or not 0.0 <= decode_reserve < 1.0:
            raise ValueError("swap_out_threshold and decode_reserve must be in [0, 1)")
        super().__init__(chunk_size, policy, chunk_cost, key_refresh_s)
        self.gpu = BlockPool(num_gpu_blocks)
        self.cpu: BlockPool | None = (
            BlockPool(num_cpu_blocks) if policy.uses_cpu_tier and num_cpu_blocks > 0 else None
        )
        self.swap_out_threshold_blocks = int(swap_out_threshold * num_gpu_blocks)
        self.swap_out_batch_blocks = int(swap_out_batch * num_gpu_blocks)
        """Once under the threshold, free this many blocks beyond it: swaps go in batches
        (longer copies, one eviction pass per batch instead of one per step)."""
        self.decode_reserve_blocks = int(decode_reserve * num_gpu_blocks)
        self.stats = CacheStats()
        self.disk: DiskIndex | None = None
        """The disk tier below the CPU tier (:mod:`pensieve.core.disk_index`); None: none."""
        self.tenant_share: TenantShare | None = None
        """Per-tenant share of each tier that hints cannot exceed (None: no bound)."""
        self._hints_due: set[Conversation] = set()
        """Conversations whose tenant crossed its share in an eviction, re-keyed once the
        eviction's run is over (a run holds its victim at the top of the GPU heap)."""
        self._reclaim_groups: deque[list[int]] = deque()
        """GPU blocks of each earlier step's background swap-outs, oldest first."""
        self._reclaim_group_blocks = 0
        self._reclaim_cpu: list[int] = []
        """CPU blocks of this and the previous step's swap-ins: freed when the next step
        begins (the runner has finished them by then)."""
        self._reclaim_cpu_ahead: list[int] = []
        """CPU blocks of this step's ``swap_in_ahead``: they join ``_reclaim_cpu`` when the
        next step begins, so they are freed one step later (the copies finish during the next
        step)."""
        self._plan = _StepPlan()
        self._pinned_gpu = 0
        """GPU blocks held by running conversations (all of their chunks)."""

    @property
    def has_pending_swap_outs(self) -> bool:
        """Background swap-outs whose GPU blocks are not reclaimed yet (copies may run)."""
        return bool(self._reclaim_groups)



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
        """The runner reports ``in_flight`` background swap-out batches still copying (they
        finish in plan order): free the GPU blocks of every older one."""
        if not 0 <= in_flight <= len(self._reclaim_groups):
            raise ValueError(f"{in_flight} swap-out batches reported in flight, "
                             f"{len(self._reclaim_groups)} were planned and not yet reclaimed")
        while len(self._reclaim_groups) > in_flight:
            group = self._reclaim_groups.popleft()
            self.gpu.free(group)
            self._reclaim_group_blocks -= len(group)

    def _pending_reclaim_gpu(self) -> int:
        """GPU blocks that become free once background copies finish."""
        return self._reclaim_group_blocks + len(self._plan.swap_out)


    def plan_background(self, now: float) -> None:
        """Ahead-of-time swap-out while free GPU blocks (counting those soon reclaimed) are
        under the threshold."""
        if self.cpu is None:
            return
        short = (self.swap_out_threshold_blocks - self.gpu.num_free_blocks
                 - self._pending_reclaim_gpu())
        if short > 0:
            self._evict_gpu(short + self.swap_out_batch_blocks, now, urgent=False)

    def _evictable_gpu_blocks(self) -> int:
        """GPU blocks held by idle conversations (every other taken block is pinned or
        waiting to be reclaimed)."""
        taken = self.gpu.num_blocks - self.gpu.num_free_blocks - self._pending_reclaim_gpu()
        return taken - self._pinned_gpu

    def _evict_gpu(self, n: int, now: float, urgent: bool) -> int:
        """Move (or drop) up to ``n`` idle GPU chunks, lowest key first; returns how many.

        The hot loop of the cache. The victim's chunks are taken in a run while the next one's
        key stays below every other entry of the GPU heap (the top's children bound all
        others from below, lower bounds included), so the heap is touched once per run, not
        once per chunk; the order is the one a pass chunk by chunk would take."""
        self._refresh(now)
        whole = self.policy.whole_conversation
        gpu_index = self._gpu_index
        step = self._step
        gpu_tier = Tier.GPU
        # entries keyed now go on a list to be keyed at t_e again (time-dependent keys only)
        exact = self._exact if self._time_dependent else []
        done = 0
        last: Conversation | None = None
        while True:
            top = self._peek_victim(gpu_tier)
            if top is None:
                break
            key, conv, i = top
            if done >= n and not (whole and conv is last):
                break
            heap = gpu_index.heap
            bound = (min(heap[1][0], heap[2][0]) if len(heap) > 2
                     else heap[1][0] if len(heap) == 2 else None)
            while True:
                to = self._move_gpu_chunk(conv, i, key, now, urgent)
                if self.tenant_share is not None and conv in self.tenant_share.counted:
                    self._hints_due |= self.tenant_share.moved(conv, gpu_tier, to)
                done += 1
                # the conversation's next GPU chunk takes its place in the GPU index
                j = self._first(conv, gpu_tier, i + step)
                if j is None:
                    gpu_index.pop_top(conv)
                    break
                i, key = j, self._key_now(conv, j)
                if (done >= n and not whole) or (bound is not None and not key < bound):
                    # keyed now (exact, for this eviction); at t_e again when time moves
                    gpu_index.replace_top(conv, j, key, now)
                    exact.append((gpu_index, conv))
                    break
            if self._hints_due:  # after the run: it holds conv at the top of the GPU heap
                self._apply_hints()
            last = conv
        return done

    def _apply_hints(self, convs: set[Conversation] | None = None) -> None:
        """The policy reads each conversation's hints as its tenant's share allows
        (``convs``, else those whose tenant crossed its share since the last call)."""
        share = self.tenant_share
        assert share is not None
        if convs is None:
            convs, self._hints_due = self._hints_due, set()
        for conv in convs:
            effective = share.effective(conv)
            if effective != (conv.priority, conv.keep_alive_s):
                conv.priority, conv.keep_alive_s = effective
                self._rekey(conv)

    def _move_gpu_chunk(self, conv: Conversation, i: int, key: EvictionKey, now: float,
                        urgent: bool) -> Tier:
        """GPU chunk ``i`` of ``conv`` (key ``key`` now) leaves for a free CPU block, or one
        freed by dropping the CPU tier's lowest chunk if that one's key is lower, else it is
        dropped; returns the tier it went to. The caller moves the GPU index; the CPU index
        follows here."""
        ch = conv.chunks[i]
        c = self.chunk_size
        tokens = min(c, conv.kv_end - i * c)
        cpu, stats = self.cpu, self.stats
        cpu_block = -1
        if cpu is not None:
            if cpu.num_free_blocks:
                cpu_block = cpu.allocate_one()
            else:
                victim = self._peek_victim(Tier.CPU)
                if victim is not None and not key < victim[0]:
                    self._drop_cpu_victim(victim[1], victim[2])
                    cpu_block = cpu.allocate_one()
        if cpu_block < 0:
            if self.disk is not None:  # dropped from the GPU: to the disk tier instead
                spill_to_disk(self, conv, i)
            self.gpu.free_one(ch.block)
            ch.tier, ch.block = Tier.DROPPED, -1
            stats.dropped_tokens += tokens
            return Tier.DROPPED
        if urgent:
            self._plan.swap_out_first[cpu_block] = ch.block
            self.gpu.free_one(ch.block)
        else:
            self._plan.swap_out[cpu_block] = ch.block
        ch.tier, ch.block = Tier.CPU, cpu_block
        stats.swapped_out_tokens += tokens
        # chunk i reached the CPU: the CPU index's cursor moves back?
        cpu_index = self._cpu_index
        entry = cpu_index.live.get(conv)
        if entry is None or (i - entry[0]) * self._step < 0:
            cpu_index.set(conv, i, key, now)
            if self._time_dependent:
                self._exact.append((cpu_index, conv))
        return Tier.CPU

    def _evict_chunk(self, conv: Conversation, i: int, urgent: bool) -> None:
        """One GPU chunk leaves the GPU outside an eviction pass (a suspension): to a CPU block
        if the tier has or can make room. The caller updates the conversation's index."""
        ch = conv.chunks[i]
        tokens = conv.chunk_tokens(i, self.chunk_size)
        cpu_block = self._cpu_block_for(conv, i)
        if cpu_block is None:
            if self.disk is not None:
                spill_to_disk(self, conv, i)
            self.gpu.free_one(ch.block)
            ch.tier, ch.block = Tier.DROPPED, -1
            self.stats.dropped_tokens += tokens
            return
        if urgent:
            self._plan.swap_out_first[cpu_block] = ch.block
            self.gpu.free_one(ch.block)
        else:
            self._plan.swap_out[cpu_block] = ch.block
        ch.tier, ch.block = Tier.CPU, cpu_block
        self.stats.swapped_out_tokens += tokens

    def _cpu_block_for(self, conv: Conversation, i: int) -> int | None:
        """A free CPU block, dropping the CPU chunk of lowest key if that key is lower than
        the incoming chunk's (else None: the incoming chunk is the one to drop)."""
        cpu = self.cpu
        if cpu is None:
            return None
        if cpu.num_free_blocks == 0:
            victim = self._peek_victim(Tier.CPU)
            if victim is None or self._key_now(conv, i) < victim[0]:
                return None
            self._drop_cpu_victim(victim[1], victim[2])
            if self._hints_due:
                self._apply_hints()
        return cpu.allocate_one()

    def _drop_cpu_victim(self, conv: Conversation, i: int) -> None:
        """Drop the CPU tier's lowest chunk (its entry is the CPU index's top)."""
        self.stats.dropped_tokens += conv.chunk_tokens(i, self.chunk_size)
        if self.disk is not None:  # to the disk tier instead, when it takes it
            spill_to_disk(self, conv, i)
        self._drop_cpu_chunk(conv, i)
        j = self._first(conv, Tier.CPU, i + self._step)
        if j is None:
            self._cpu_index.pop_top(conv)
        else:
            self._cpu_index.replace_top(conv, j, self._key_now(conv, j), self._now)
            if self._time_dependent:
                self._exact.append((self._cpu_index, conv))
        if self.tenant_share is not None and conv in self.tenant_share.counted:
            self._hints_due |= self.tenant_share.moved(conv, Tier.CPU, Tier.DROPPED)

    def _drop_cpu_chunk(self, conv: Conversation, i: int) -> None:
        """Chunk ``i`` leaves the CPU tier without a copy (its KV is to be recomputed)."""
        assert self.cpu is not None
        ch = conv.chunks[i]
        self._cancel_swap_out(ch.block, conv.chunk_tokens(i, self.chunk_size))
        self.cpu.free_one(ch.block)
        ch.tier, ch.block = Tier.DROPPED, -1

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


    def _check_pool(self, pool: BlockPool, tier: Tier, reclaim: list[int]) -> None:
        owners: dict[int, str] = {}
        for conv in self.conversations.values():
            for ch in conv.chunks:
                if ch.tier is tier:
                    assert ch.block not in owners, f"{tier} block {ch.block} held twice"
                    assert not pool.is_free(ch.block), f"{tier} block {ch.block} held and free"
                    owners[ch.block] = conv.conversation_id
        for b in reclaim:
            assert b not in owners and not pool.is_free(b), f"{tier} block {b} reclaim clash"
            owners[b] = "<reclaim>"
        total = len(owners) + pool.num_free_blocks
        assert total == pool.num_blocks, f"{tier}: {total} accounted of {pool.num_blocks}"

