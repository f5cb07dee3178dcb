"""The two-tier KV cache: every conversation's chunks on the GPU, on the CPU, or dropped.

Owns two block pools (GPU and CPU), the conversations, and the copies each step needs. The
scheduler asks it to *admit* a turn (bring the conversation's chunks to the GPU: swap CPU
chunks in, plan recomputation of dropped ones, add blocks for new tokens), to *grow* a running
turn, to *suspend* or *end* one. Room is made by evicting chunks of idle conversations in the
order of an :class:`~pensieve.core.eviction.EvictionPolicy`.

Block life cycle, and why reclaiming is lazy. A GPU block sent to the CPU ahead of time stays
taken until the next step (its copy runs beside this step's compute); a CPU block whose chunk
was swapped in likewise (a swap-out planned in the same step must not overwrite it before it is
read). Urgent evictions (``swap_out_first``) free their GPU block at once: the runner copies
them before the step touches any KV.

Invariants (:meth:`check_integrity`): each GPU and CPU block is free, held by exactly one chunk
of its tier, or waiting to be reclaimed, never two of these; each chunk is in exactly one tier;
a running conversation has all its chunks on the GPU; an idle one has ``cdiv(kv_end, C)``.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field

from pensieve.core.block_pool import BlockPool
from pensieve.core.conversation import Chunk, Conversation, Tier
from pensieve.core.eviction import ChunkCost, EvictionKey, EvictionPolicy
from pensieve.core.outputs import SwapPlan
from pensieve.core.request import Request
from pensieve.core.stats import CacheStats

Interval = tuple[int, int]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _StepPlan:
    swap_out_first: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)


class TieredKVCache:
    """GPU and CPU block pools plus every conversation's chunk map."""

    def __init__(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        chunk_size: int,
        policy: EvictionPolicy,
        chunk_cost: ChunkCost,
        swap_out_threshold: float = 0.25,
        decode_reserve: float = 0.10,
        swap_out_batch: float = 0.05,
    ) -> None:
        if not 0.0 <= swap_out_threshold < 1.0 or not 0.0 <= decode_reserve < 1.0:
            raise ValueError("swap_out_threshold and decode_reserve must be in [0, 1)")
        self.chunk_size = chunk_size
        self.policy = policy
        self.chunk_cost = chunk_cost
        self.gpu = BlockPool(num_gpu_blocks)
        self.cpu: BlockPool | None = (
            BlockPool(num_cpu_blocks) if policy.uses_cpu_tier and num_cpu_blocks > 0 else None
        )
        self.swap_out_threshold_blocks = int(swap_out_threshold * num_gpu_blocks)
        self.swap_out_batch_blocks = int(swap_out_batch * num_gpu_blocks)
        """Once under the threshold, free this many blocks beyond it: swaps go in batches
        (longer copies, one eviction pass per batch instead of one per step)."""
        self.decode_reserve_blocks = int(decode_reserve * num_gpu_blocks)
        self.conversations: dict[str, Conversation] = {}
        self.stats = CacheStats()
        self._reclaim_gpu: list[int] = []
        self._reclaim_cpu: list[int] = []
        self._plan = _StepPlan()
        self._fresh_cpu: set[int] = set()  # CPU blocks that are swap-out targets this step

    # ------------------------------------------------------------------ conversations
    def conversation(self, conversation_id: str, ephemeral: bool = False) -> Conversation:
        """The conversation of that id, created empty if new."""
        conv = self.conversations.get(conversation_id)
        if conv is None:
            conv = Conversation(conversation_id, ephemeral=ephemeral)
            self.conversations[conversation_id] = conv
        return conv

    def delete(self, conversation_id: str) -> None:
        """Forget a conversation: its blocks in both tiers go back to the pools."""
        conv = self.conversations.get(conversation_id)
        if conv is None:
            return
        if conv.running:
            raise ValueError(f"conversation {conversation_id!r} has a turn running")
        self._free_chunks(conv, 0)
        del self.conversations[conversation_id]

    def block_table(self, conv: Conversation) -> list[int]:
        """GPU blocks of a running conversation, chunk by chunk."""
        return [c.block for c in conv.chunks]

    # ------------------------------------------------------------------ a step
    def begin_step(self) -> None:
        """Reclaim blocks whose copies finished with the previous step."""
        self.gpu.free(self._reclaim_gpu)
        self._reclaim_gpu = []
        if self.cpu is not None:
            self.cpu.free(self._reclaim_cpu)
        self._reclaim_cpu = []
        self._fresh_cpu = set()

    def take_swap_plan(self) -> SwapPlan:
        p, self._plan = self._plan, _StepPlan()
        return SwapPlan(p.swap_out_first, p.swap_in, p.swap_out)

    # ------------------------------------------------------------------ admitting a turn
    def pending_for(self, req: Request, conv: Conversation) -> list[Interval]:
        """Positions the turn must compute: dropped chunks, then everything from kv_end."""
        c = self.chunk_size
        holes: list[Interval] = []
        for i, chunk in enumerate(conv.chunks):
            if chunk.tier is Tier.DROPPED:
                lo, hi = i * c, min((i + 1) * c, conv.kv_end)
                if holes and holes[-1][1] == lo:
                    holes[-1] = (holes[-1][0], hi)
                else:
                    holes.append((lo, hi))
        tail = (min(conv.kv_end, req.num_tokens - 1), req.num_tokens)
        if holes and holes[-1][1] == tail[0]:
            holes[-1] = (holes[-1][0], tail[1])
        else:
            holes.append(tail)
        return holes

    def admit(self, req: Request, conv: Conversation, first_end: int, now: float) -> bool:
        """Pin the conversation on the GPU for this turn, with blocks up to ``first_end``.

        Returns False, changing nothing, when the GPU cannot make room while keeping the
        decode reserve free. On success sets ``req.pending`` and counts the turn's sources.
        """
        c = self.chunk_size
        missing = [i for i, ch in enumerate(conv.chunks) if ch.tier is not Tier.GPU]
        need = len(missing) + max(0, cdiv(first_end, c) - len(conv.chunks))
        shortfall = need + self.decode_reserve_blocks - self.gpu.num_free_blocks
        conv.running = True  # pinned: never its own victim
        if shortfall > 0:
            if self._evictable_gpu_blocks() < shortfall:
                conv.running = False
                return False
            self._evict_gpu(shortfall, now, urgent=True)
        req.pending = self.pending_for(req, conv)
        st = CacheStats()
        for i, ch in enumerate(conv.chunks):
            tokens = conv.chunk_tokens(i, c)
            if ch.tier is Tier.GPU:
                st.gpu_hit_tokens += tokens
            elif ch.tier is Tier.CPU:
                block = self.gpu.allocate(1)[0]
                self._plan.swap_in.append((ch.block, block))
                self._reclaim_cpu.append(ch.block)
                ch.tier, ch.block = Tier.GPU, block
                st.cpu_hit_tokens += tokens
                st.swapped_in_tokens += tokens
            else:
                ch.tier, ch.block = Tier.GPU, self.gpu.allocate(1)[0]
                st.recomputed_tokens += tokens
        history_kv = max(len(conv.token_ids) - 1, 0)  # KV that existed after the last turn
        st.recomputed_tokens += max(0, history_kv - conv.kv_end)
        st.new_prompt_tokens += req.num_tokens - max(conv.kv_end, history_kv)
        self._extend(conv, first_end)
        self._count(req, st)
        return True

    def grow(self, conv: Conversation, end: int, now: float) -> bool:
        """Give a running conversation blocks up to position ``end``; False if impossible."""
        need = cdiv(end, self.chunk_size) - len(conv.chunks)
        shortfall = need - self.gpu.num_free_blocks
        if shortfall > 0 and self._evict_gpu(shortfall, now, True) < shortfall:
            return False
        self._extend(conv, end)
        return True

    def _extend(self, conv: Conversation, end: int) -> None:
        need = cdiv(end, self.chunk_size) - len(conv.chunks)
        for b in self.gpu.allocate(max(need, 0)):
            conv.chunks.append(Chunk(Tier.GPU, b))

    # ------------------------------------------------------------------ ending a turn
    def end_turn(self, req: Request, conv: Conversation, now: float) -> None:
        """The turn finished: record it in the history; keep, or free, its KV."""
        self._settle(conv, req.pending, req.num_tokens)
        conv.token_ids = req.all_token_ids
        conv.running = False
        conv.last_active = now
        if conv.ephemeral:
            self.delete(conv.conversation_id)
        elif not self.policy.keeps_kv:
            self._free_chunks(conv, 0)

    def abort_turn(self, req: Request, conv: Conversation, now: float) -> None:
        """The turn is abandoned: the conversation stays as it was before it."""
        if conv.running:
            self._settle(conv, req.pending, req.num_tokens)
            conv.running = False
        self._truncate(conv, min(conv.kv_end, len(conv.token_ids)))
        if conv.ephemeral:
            self.delete(conv.conversation_id)

    def suspend(self, req: Request, conv: Conversation, now: float) -> None:
        """Take a running turn off the GPU: its chunks go to the CPU (or are dropped)."""
        self._settle(conv, req.pending, req.num_tokens)
        conv.running = False
        conv.last_active = now
        req.pending = []
        cpu_victims = _Peekable(self, now)
        for i, ch in enumerate(conv.chunks):
            if ch.tier is Tier.GPU:
                self._evict_chunk(conv, i, now, True, cpu_victims)
        self.stats.suspended_requests += 1
        req.cache_stats.suspended_requests += 1

    def _settle(self, conv: Conversation, pending: list[Interval], num_tokens: int) -> None:
        """Make the chunk map true after a turn stops: positions still pending have no KV."""
        kv_end = pending[-1][0] if pending else num_tokens
        c = self.chunk_size
        for lo, hi in pending[:-1]:  # unfinished recomputation: those chunks are dropped
            for i in range(lo // c, cdiv(hi, c)):
                ch = conv.chunks[i]
                if ch.tier is Tier.GPU:
                    self.gpu.free([ch.block])
                ch.tier, ch.block = Tier.DROPPED, -1
        self._truncate(conv, kv_end)

    def _truncate(self, conv: Conversation, kv_end: int) -> None:
        """Set ``kv_end`` and free the chunks wholly past it."""
        conv.kv_end = kv_end
        self._free_chunks(conv, cdiv(kv_end, self.chunk_size))

    def _free_chunks(self, conv: Conversation, keep: int) -> None:
        """Free the blocks of chunks ``keep..`` and forget those chunks."""
        for ch in conv.chunks[keep:]:
            if ch.tier is Tier.GPU:
                self.gpu.free([ch.block])
            elif ch.tier is Tier.CPU and self.cpu is not None:
                self.cpu.free([ch.block])
        del conv.chunks[keep:]
        conv.kv_end = min(conv.kv_end, keep * self.chunk_size)

    # ------------------------------------------------------------------ eviction
    def plan_background(self, now: float) -> None:
        """Ahead-of-time swap-out while free GPU blocks are under the threshold."""
        if self.cpu is None:
            return
        short = self.swap_out_threshold_blocks - self.gpu.num_free_blocks - len(self._reclaim_gpu)
        if short > 0:
            self._evict_gpu(short + self.swap_out_batch_blocks, now, urgent=False)

    def _victims(self, tier: Tier, now: float) -> Iterator[tuple[EvictionKey, Conversation, int]]:
        """Chunks of idle conversations in ``tier``, lowest key first, produced lazily.

        Within one conversation keys only grow in the policy's chunk order (leading chunks
        first; the tail first for prefix caches), so a heap holds one candidate per
        conversation: the cost of a step's eviction is the conversations touched, not every
        chunk in the cache. The caller may move the chunk it was given out of ``tier`` before
        asking for the next one."""
        step = -1 if self.policy.tail_first else 1

        def first(conv: Conversation, start: int) -> int | None:
            n = len(conv.chunks)
            i = start
            while 0 <= i < n:
                if conv.chunks[i].tier is tier:
                    return i
                i += step
            return None

        heap: list[tuple[EvictionKey, int, int]] = []
        convs = [c for c in self.conversations.values() if not c.running]
        for n, conv in enumerate(convs):
            i = first(conv, 0 if step == 1 else len(conv.chunks) - 1)
            if i is not None:
                heap.append((self._key(conv, i, now), n, i))
        heapq.heapify(heap)
        while heap:
            key, n, i = heapq.heappop(heap)
            conv = convs[n]
            if i < len(conv.chunks) and conv.chunks[i].tier is tier and not conv.running:
                yield key, conv, i
            j = first(conv, i + step) if not conv.running else None
            if j is not None:
                heapq.heappush(heap, (self._key(conv, j, now), n, j))

    def _key(self, conv: Conversation, i: int, now: float) -> EvictionKey:
        return self.policy.key(conv, i, now, self.chunk_cost, self.chunk_size)

    def _evictable_gpu_blocks(self) -> int:
        """GPU blocks held by idle conversations (every other taken block is pinned)."""
        taken = self.gpu.num_blocks - self.gpu.num_free_blocks - len(self._reclaim_gpu)
        pinned = sum(ch.tier is Tier.GPU for c in self.conversations.values() if c.running
                     for ch in c.chunks)
        return taken - pinned

    def _evict_gpu(self, n: int, now: float, urgent: bool) -> int:
        """Move (or drop) up to ``n`` idle GPU chunks, lowest key first; returns how many."""
        done = 0
        last: Conversation | None = None
        cpu_victims = _Peekable(self, now)
        for _, conv, i in self._victims(Tier.GPU, now):
            whole = self.policy.whole_conversation and conv is last
            if done >= n and not whole:
                break
            self._evict_chunk(conv, i, now, urgent, cpu_victims)
            done += 1
            last = conv
        return done

    def _evict_chunk(
        self, conv: Conversation, i: int, now: float, urgent: bool, cpu_victims: _Peekable
    ) -> None:
        """One GPU chunk leaves the GPU: to a CPU block if the tier has or can make room."""
        ch = conv.chunks[i]
        tokens = conv.chunk_tokens(i, self.chunk_size)
        cpu_block = self._cpu_block_for(conv, i, now, cpu_victims)
        if cpu_block is None:
            self.gpu.free([ch.block])
            ch.tier, ch.block = Tier.DROPPED, -1
            self.stats.dropped_tokens += tokens
            return
        if urgent:
            self._plan.swap_out_first.append((ch.block, cpu_block))
            self.gpu.free([ch.block])
        else:
            self._plan.swap_out.append((ch.block, cpu_block))
            self._reclaim_gpu.append(ch.block)
        ch.tier, ch.block = Tier.CPU, cpu_block
        self._fresh_cpu.add(cpu_block)
        self.stats.swapped_out_tokens += tokens

    def _cpu_block_for(
        self, conv: Conversation, i: int, now: float, cpu_victims: _Peekable
    ) -> int | None:
        """A free CPU block, dropping the CPU chunk of lowest key if that key is lower than
        the incoming chunk's (else None: the incoming chunk is the one to drop)."""
        if self.cpu is None:
            return None
        if self.cpu.num_free_blocks == 0:
            victim = cpu_victims.peek()
            if victim is None:
                return None
            key, vconv, vi = victim
            mine = self._key(conv, i, now)
            if mine < key:
                return None
            cpu_victims.pop()
            vch = vconv.chunks[vi]
            if vch.block in self._fresh_cpu:  # its copy is not issued yet: cancel it
                self._cancel_swap_out(vch.block, vconv.chunk_tokens(vi, self.chunk_size))
            self.cpu.free([vch.block])
            vch.tier, vch.block = Tier.DROPPED, -1
            self.stats.dropped_tokens += vconv.chunk_tokens(vi, self.chunk_size)
        return self.cpu.allocate(1)[0]

    def _cancel_swap_out(self, cpu_block: int, tokens: int) -> None:
        """Forget this step's copy into ``cpu_block`` (its chunk is being dropped instead)."""
        self._fresh_cpu.discard(cpu_block)
        for plan in (self._plan.swap_out_first, self._plan.swap_out):
            plan[:] = [(g, c) for g, c in plan if c != cpu_block]
        self.stats.swapped_out_tokens -= tokens

    def _count(self, req: Request, st: CacheStats) -> None:
        self.stats.add(st)
        req.cache_stats.add(st)

    # ------------------------------------------------------------------ audit
    def check_integrity(self) -> None:
        """Raise AssertionError if any block or chunk is accounted for twice or not at all."""
        self._check_pool(self.gpu, Tier.GPU, self._reclaim_gpu)
        if self.cpu is not None:
            self._check_pool(self.cpu, Tier.CPU, self._reclaim_cpu)
        for conv in self.conversations.values():
            n = len(conv.chunks)
            if conv.running:
                assert all(ch.tier is Tier.GPU for ch in conv.chunks), conv.conversation_id
            else:
                assert n == cdiv(conv.kv_end, self.chunk_size), (conv.conversation_id, n)
            for ch in conv.chunks:
                assert (ch.block >= 0) == (ch.tier is not Tier.DROPPED), ch

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


class _Peekable:
    """The CPU tier's victims for one eviction pass, made on first use and then consumed.

    A conversation with no CPU chunk when it is made is not in it: chunks that reach the CPU
    during this pass are not dropped again in the same pass."""

    def __init__(self, cache: TieredKVCache, now: float) -> None:
        self._cache, self._now = cache, now
        self._it: Iterator[tuple[EvictionKey, Conversation, int]] | None = None
        self._head: tuple[EvictionKey, Conversation, int] | None = None

    def peek(self) -> tuple[EvictionKey, Conversation, int] | None:
        if self._it is None:
            self._it = self._cache._victims(Tier.CPU, self._now)
        while self._head is not None:
            _, conv, i = self._head
            if not conv.running and i < len(conv.chunks) and conv.chunks[i].tier is Tier.CPU:
                return self._head
            self._head = None
        self._head = next(self._it, None)
        return self._head

    def pop(self) -> None:
        self._head = None
