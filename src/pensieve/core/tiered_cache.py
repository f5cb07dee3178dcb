"""The two-tier KV cache: every conversation's chunks on the GPU, on the CPU, or dropped.

Owns two block pools (GPU and CPU), the conversations, and the copies each step needs. The
scheduler asks it to *admit* a turn (bring the conversation's chunks to the GPU: swap CPU
chunks in or recompute them, plan recomputation of dropped ones, add blocks for new tokens), to
*grow* a running turn, to *suspend* or *end* one. Room is made by evicting chunks of idle
conversations in the order of an :class:`~pensieve.core.eviction.EvictionPolicy`.

Block life cycle, and why reclaiming is lazy. A GPU block sent to the CPU ahead of time
(``SwapPlan.swap_out``, a *background* swap-out) stays taken until the runner reports its copy
done: each step's background swap-outs form one *reclaim group*, groups wait in a FIFO, and
:meth:`TieredKVCache.reclaim_swap_outs` (called by the scheduler with
``RunnerOutput.swap_outs_in_flight``) frees the oldest groups until only that many remain.
A CPU block whose chunk was swapped in stays taken until the next step (a swap-out planned in
the same step must not overwrite it before it is read). Urgent evictions (``swap_out_first``)
free their GPU block at once: the runner copies them before the step touches any KV.

Eviction index: cost of a step is what it changes, not what the cache holds. Per tier (GPU,
CPU) the cache keeps the *eviction candidates*: each idle conversation with a chunk in that
tier, with its first such chunk in the policy's chunk order (leading chunks first; the tail
first for ``tail_first`` policies). Within a conversation keys only grow in that order (when
``Cost`` does not decrease with context), so the lowest key of the tier is the lowest of the
candidates. Candidates sit in a heap with lazy invalidation (each entry carries a sequence
number; the live one is recorded per conversation). A conversation's entry changes only when
it is evicted from, admitted (it leaves the index), ends, suspends or is aborted (it is
indexed again from scratch, one pass over its chunks), gets retention hints, or a chunk of it
enters the CPU tier ahead of its CPU cursor. Pinned (running) GPU blocks are a running count.

Time-dependent keys (``key_refresh_s``, ``R``). The ``pensieve`` key ``priority * Cost(l) /
idle_time(now)`` depends on ``now``, so conversations' order changes over time and no static
heap holds it. It only falls while a conversation stays idle, though, so a key evaluated at a
later time is a lower bound of the key now. The index keeps every entry keyed at one time
``t_e >= now`` (lower bounds); when an eviction at ``now`` finds a lower bound at the top of the
heap, it evaluates that entry at ``now`` and puts it back, until the top is exact: no other
chunk can then have a lower key, so the eviction order is the policy's exact order at ``now``.
Entries evaluated at ``now`` are keyed at ``t_e`` again when time moves on; once ``now`` passes
``t_e``, the whole index is re-keyed (``O(candidates)``) at ``t_e = now + R``. ``R`` trades
that re-key (at most once per ``R`` seconds) against extra evaluations within an eviction:
entries whose bound at ``t_e`` is far below their key now (conversations idle for less than a
few ``R``) surface and are evaluated once per eviction time. ``R = 0`` re-keys at every new
``now``. Keys of ``lru`` and ``prefix-lru`` do not depend on ``now`` and are used as they are.
A policy whose time-dependent key could grow while a conversation stays idle would break the
lower bounds (``EvictionPolicy.time_dependent``).

Swap or recompute (``swap_chunk_s``). A CPU chunk of an admitted turn is brought back by a
swap-in, or, when that is expected to take longer, recomputed (its CPU block freed, its
positions pending like a dropped chunk's). The two ways use different resources that run side
by side: the copy stream, which serves copies in order, and the GPU's compute. A chunk goes to
the one that would have it sooner given what that resource already has this step (greedy list
scheduling on two machines): swap when ``swap_chunk_s * (1 + queued) <= recompute_s +
chunk_cost(l)``, where ``queued`` counts the chunk copies already on the stream this step
(urgent swap-outs and swap-ins planned so far, plus background swap-outs still in flight as last
reported) and ``recompute_s`` the recomputation planned so far this step (dropped chunks and
chunks already chosen for recomputation). So a quiet stream swaps, and a stream busy with
swap-outs (thrash) pushes chunks toward recomputation, until both finish about together.
The step's other compute (new prompts, decodes) is not counted, which errs toward
recomputation when it is large. Recomputation is only chosen for chunks that fit the step's
token budget (the scheduler passes what is left), so it never delays a turn by a step; with
``swap_chunk_s = None`` every CPU chunk is swapped in.

Invariants (:meth:`check_integrity`): each GPU and CPU block is free, held by exactly one chunk
of its tier, or waiting to be reclaimed, never two of these; each chunk is in exactly one tier;
a running conversation has all its chunks on the GPU; an idle one has ``cdiv(kv_end, C)``; the
eviction index and the running counts equal a full recomputation.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from pensieve.core.block_pool import BlockPool
from pensieve.core.conversation import Chunk, Conversation, Tier
from pensieve.core.eviction import ChunkCost, EvictionKey, EvictionPolicy
from pensieve.core.outputs import SwapPlan
from pensieve.core.request import Request
from pensieve.core.stats import CacheStats

Interval = tuple[int, int]
Victim = tuple[EvictionKey, Conversation, int]
"""(key, conversation, chunk index) of an eviction candidate."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _StepPlan:
    swap_out_first: dict[int, int] = field(default_factory=dict)
    """cpu_block -> gpu_block of urgent swap-outs, in plan order."""
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swap_out: dict[int, int] = field(default_factory=dict)
    """cpu_block -> gpu_block of background swap-outs, in plan order."""


class _TierIndex:
    """Eviction candidates of one tier: per idle conversation with a chunk in the tier, the
    index of its first such chunk in the policy's order, that chunk's key and the time the key
    was evaluated at; a heap of ``(key, seq, conversation, chunk index)`` whose entry is live
    iff its ``seq`` is the one recorded for the conversation (older entries are skipped when
    they surface)."""

    __slots__ = ("live", "heap", "_seq")

    def __init__(self) -> None:
        self.live: dict[Conversation, tuple[int, int, EvictionKey, float]] = {}
        """conversation -> (chunk index, seq, key, evaluation time) of its live entry."""
        self.heap: list[tuple[EvictionKey, int, Conversation, int]] = []
        self._seq = 0

    def set(self, conv: Conversation, index: int, key: EvictionKey, t: float) -> None:
        self._seq += 1
        self.live[conv] = (index, self._seq, key, t)
        heapq.heappush(self.heap, (key, self._seq, conv, index))
        if len(self.heap) > 2 * len(self.live) + 64:
            self._rebuild(self.live)

    def discard(self, conv: Conversation) -> None:
        self.live.pop(conv, None)

    def replace_top(self, conv: Conversation, index: int, key: EvictionKey, t: float) -> None:
        """Like :meth:`set`, when ``conv``'s live entry is the heap's top (:meth:`peek` just
        returned it): one sift."""
        self._seq += 1
        self.live[conv] = (index, self._seq, key, t)
        heapq.heapreplace(self.heap, (key, self._seq, conv, index))

    def pop_top(self, conv: Conversation) -> None:
        """Like :meth:`discard`, when ``conv``'s live entry is the heap's top."""
        del self.live[conv]
        heapq.heappop(self.heap)

    def peek(self) -> Victim | None:
        heap, live = self.heap, self.live
        while heap:
            key, seq, conv, index = heap[0]
            entry = live.get(conv)
            if entry is not None and entry[1] == seq:
                return key, conv, index
            heapq.heappop(heap)
        return None

    def rekey(self, key_of: dict[Conversation, EvictionKey], t: float) -> None:
        """Every candidate's key anew (same chunk), evaluated at ``t``."""
        self._rebuild({c: (i, s, key_of[c], t) for c, (i, s, _, _) in self.live.items()})

    def _rebuild(self, live: dict[Conversation, tuple[int, int, EvictionKey, float]]) -> None:
        self.live = {}
        self.heap = []
        for conv, (index, _, key, t) in live.items():
            self._seq += 1
            self.live[conv] = (index, self._seq, key, t)
            self.heap.append((key, self._seq, conv, index))
        heapq.heapify(self.heap)


class TieredKVCache:
    """GPU and CPU block pools plus every conversation's chunk map."""

    _exact_max = 1024
    """Entries keyed at one ``now`` kept listed before they are made bounds again anyway."""

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
        key_refresh_s: float = 0.5,
        swap_chunk_s: float | None = None,
    ) -> None:
        """``key_refresh_s``: how far ahead (seconds) time-dependent eviction keys are
        evaluated, i.e. how often at most the whole index is re-keyed; the eviction order is
        exact whatever its value (see the module docstring). ``swap_chunk_s``: seconds to
        move one chunk (all layers) one way between the tiers at the measured rate; with it,
        admission recomputes a CPU chunk instead of swapping it in when that is expected to be
        sooner (see the module docstring); None: always swap in."""
        if not 0.0 <= swap_out_threshold < 1.0 or not 0.0 <= decode_reserve < 1.0:
            raise ValueError("swap_out_threshold and decode_reserve must be in [0, 1)")
        if not key_refresh_s >= 0.0:
            raise ValueError(f"key_refresh_s must be >= 0, got {key_refresh_s}")
        if swap_chunk_s is not None and not (swap_chunk_s >= 0.0 and math.isfinite(swap_chunk_s)):
            raise ValueError(f"swap_chunk_s must be a finite time >= 0, got {swap_chunk_s}")
        self.chunk_size = chunk_size
        self.policy = policy
        self.chunk_cost = chunk_cost
        self.key_refresh_s = key_refresh_s
        self.swap_chunk_s = swap_chunk_s
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
        self._reclaim_groups: deque[list[int]] = deque()
        """GPU blocks of each earlier step's background swap-outs, oldest first."""
        self._reclaim_group_blocks = 0
        self._reclaim_cpu: list[int] = []
        self._plan = _StepPlan()
        self._pinned_gpu = 0
        """GPU blocks held by running conversations (all of their chunks)."""
        self._gpu_index = _TierIndex()
        self._cpu_index = _TierIndex()
        self._t_eval = -math.inf
        """``t_e``: the index's keys are evaluated at ``t_e`` (lower bounds while ``now <=
        t_e``), or exactly at :attr:`_now` for the entries in :attr:`_exact` (module
        docstring)."""
        self._now = -math.inf
        """``now`` of the last eviction (and of the one under way)."""
        self._exact: list[tuple[_TierIndex, Conversation]] = []
        """Entries keyed at ``_now`` (not ``t_e``): keyed again at ``t_e`` when time moves."""
        self._time_dependent = policy.time_dependent
        self._step = -1 if policy.tail_first else 1
        self._costs: dict[int, float] = {}
        self._step_recompute_s = 0.0
        """Recomputation planned this step (seconds of compute, by ``chunk_cost``)."""

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
        self._unindex(conv)
        self._free_chunks(conv, 0)
        del self.conversations[conversation_id]

    def set_queued(self, conv: Conversation, queued_at: float | None) -> None:
        """A turn of ``conv`` now waits in the queue (since ``queued_at``), or no longer does
        (None); the policy's key reads it (``pensieve``: queued conversations go last)."""
        if conv.queued_at == queued_at:
            return
        conv.queued_at = queued_at
        self._rekey(conv)

    def set_hints(self, conv: Conversation, priority: float | None = None,
                  keep_alive_s: float | None = None) -> None:
        """Change the retention hints the policy's key reads (and the key with them)."""
        if priority is not None:
            conv.priority = float(priority)
        if keep_alive_s is not None:
            conv.keep_alive_s = float(keep_alive_s)
        self._rekey(conv)

    def _rekey(self, conv: Conversation) -> None:
        """The inputs of ``conv``'s keys changed: its index entries follow."""
        if not conv.running:
            for index in (self._gpu_index, self._cpu_index):
                entry = index.live.get(conv)
                if entry is not None:
                    index.set(conv, entry[0], self._key(conv, entry[0]), self._t_eval)

    def block_table(self, conv: Conversation) -> tuple[int, ...]:
        """GPU blocks of a running conversation, chunk by chunk."""
        if conv.running:
            return conv.block_table
        return tuple(c.block for c in conv.chunks)

    @property
    def has_pending_swap_outs(self) -> bool:
        """Background swap-outs whose GPU blocks are not reclaimed yet (copies may run)."""
        return bool(self._reclaim_groups)

    # ------------------------------------------------------------------ a step
    def begin_step(self) -> None:
        """Reclaim CPU blocks whose chunks were swapped in by the previous step."""
        if self.cpu is not None:
            self.cpu.free(self._reclaim_cpu)
        self._reclaim_cpu = []
        self._step_recompute_s = 0.0

    def take_swap_plan(self) -> SwapPlan:
        """This step's copies; its background swap-outs become a reclaim group."""
        p, self._plan = self._plan, _StepPlan()
        out = [(g, c) for c, g in p.swap_out.items()]
        if out:
            self._reclaim_groups.append([g for g, _ in out])
            self._reclaim_group_blocks += len(out)
        return SwapPlan([(g, c) for c, g in p.swap_out_first.items()], p.swap_in, out)

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

    def admit(self, req: Request, conv: Conversation, first_end: int, now: float,
              spare_tokens: int | None = None) -> bool:
        """Pin the conversation on the GPU for this turn, with blocks up to ``first_end``.

        Returns False, changing nothing, when the GPU cannot make room while keeping the
        decode reserve free. On success sets ``req.pending`` and counts the turn's sources.
        ``spare_tokens``: tokens of this step's budget left beyond the turn's share (bounds
        CPU chunks chosen for recomputation; None: no bound). Positions so chosen join
        ``req.pending`` before ``first_end``, so the blocks up to ``first_end`` still suffice.
        """
        c = self.chunk_size
        chunks = conv.chunks
        on_gpu = sum(1 for ch in chunks if ch.tier is Tier.GPU)
        need = len(chunks) - on_gpu + max(0, cdiv(first_end, c) - len(chunks))
        shortfall = need + self.decode_reserve_blocks - self.gpu.num_free_blocks
        if shortfall > 0 and self._evictable_gpu_blocks() - on_gpu < shortfall:
            return False
        self._unindex(conv)
        conv.running = True  # pinned: never its own victim
        conv.queued_at = None  # out of the index while running; ended turns re-index
        if shortfall > 0:
            self._evict_gpu(shortfall, now, urgent=True)
        st = CacheStats()
        if self.swap_chunk_s is not None and self.cpu is not None:
            st.cpu_recomputed_tokens = self._choose_recompute(conv, spare_tokens)
        req.pending = self.pending_for(req, conv)
        gpu, swap_in, reclaim_cpu = self.gpu, self._plan.swap_in, self._reclaim_cpu
        kv_end, gpu_tier, cpu_tier = conv.kv_end, Tier.GPU, Tier.CPU
        table: list[int] = []
        hit = swapped = recomputed = 0
        for i, ch in enumerate(chunks):
            tokens = min(c, kv_end - i * c)  # > 0: an idle conversation has cdiv(kv_end, c)
            tier = ch.tier
            if tier is gpu_tier:
                hit += tokens
            else:
                block = gpu.allocate_one()
                if tier is cpu_tier:
                    swap_in.append((ch.block, block))
                    reclaim_cpu.append(ch.block)
                    swapped += tokens
                else:
                    recomputed += tokens
                ch.tier, ch.block = gpu_tier, block
            table.append(ch.block)
        conv.block_table = tuple(table)
        st.gpu_hit_tokens += hit
        st.cpu_hit_tokens += swapped
        st.swapped_in_tokens += swapped
        st.recomputed_tokens += recomputed
        self._pinned_gpu += len(chunks)
        history_kv = max(len(conv.token_ids) - 1, 0)  # KV that existed after the last turn
        st.recomputed_tokens += max(0, history_kv - conv.kv_end)
        st.new_prompt_tokens += req.num_tokens - max(conv.kv_end, history_kv)
        self._extend(conv, first_end)
        self._count(req, st)
        return True

    def _choose_recompute(self, conv: Conversation, spare_tokens: int | None) -> int:
        """Turn the CPU chunks that are sooner recomputed than swapped in into dropped ones
        (module docstring); returns their tokens."""
        swap_s = self.swap_chunk_s
        assert swap_s is not None
        c = self.chunk_size
        chunks = conv.chunks
        recompute_s = self._step_recompute_s
        for i, ch in enumerate(chunks):
            if ch.tier is Tier.DROPPED:
                recompute_s += self._cost(min((i + 1) * c, conv.kv_end))
        queued = (len(self._plan.swap_out_first) + len(self._plan.swap_in)
                  + self._reclaim_group_blocks)
        spare = math.inf if spare_tokens is None else spare_tokens
        converted = 0
        for i, ch in enumerate(chunks):
            if ch.tier is not Tier.CPU:
                continue
            tokens = conv.chunk_tokens(i, c)
            cost = self._cost(min((i + 1) * c, conv.kv_end))
            if recompute_s + cost < swap_s * (1 + queued) and tokens <= spare:
                self._drop_cpu_chunk(conv, i)
                recompute_s += cost
                spare -= tokens
                converted += tokens
            else:
                queued += 1
        self._step_recompute_s = recompute_s
        return converted

    def grow(self, conv: Conversation, end: int, now: float) -> bool:
        """Give a running conversation blocks up to position ``end``; False if impossible."""
        need = cdiv(end, self.chunk_size) - len(conv.chunks)
        shortfall = need - self.gpu.num_free_blocks
        if shortfall > 0 and self._evict_gpu(shortfall, now, True) < shortfall:
            return False
        self._extend(conv, end)
        return True

    def _extend(self, conv: Conversation, end: int) -> None:
        """More GPU chunks for a running conversation, up to position ``end``."""
        need = cdiv(end, self.chunk_size) - len(conv.chunks)
        if need <= 0:
            return
        blocks = self.gpu.allocate(need)
        conv.chunks.extend(Chunk(Tier.GPU, b) for b in blocks)
        conv.block_table += tuple(blocks)
        self._pinned_gpu += need

    # ------------------------------------------------------------------ ending a turn
    def end_turn(self, req: Request, conv: Conversation, now: float) -> None:
        """The turn finished: record it in the history; keep, or free, its KV."""
        self._release(conv)
        self._settle(conv, req.pending, req.num_tokens)
        conv.token_ids = req.all_token_ids
        conv.last_active = now
        if conv.ephemeral:
            self.delete(conv.conversation_id)
            return
        if not self.policy.keeps_kv:
            self._free_chunks(conv, 0)
        self._index(conv)

    def abort_turn(self, req: Request, conv: Conversation, now: float) -> None:
        """The turn is abandoned: the conversation stays as it was before it."""
        if conv.running:
            self._release(conv)
            self._settle(conv, req.pending, req.num_tokens)
        self._truncate(conv, min(conv.kv_end, len(conv.token_ids)))
        if conv.ephemeral:
            self.delete(conv.conversation_id)
        else:
            self._index(conv)

    def suspend(self, req: Request, conv: Conversation, now: float) -> None:
        """Take a running turn off the GPU: its chunks go to the CPU (or are dropped)."""
        self._refresh(now)
        self._release(conv)
        self._settle(conv, req.pending, req.num_tokens)
        conv.last_active = now
        req.pending = []
        self._index(conv)  # idle: its chunks that reach the CPU compete there like any other
        for i, ch in enumerate(conv.chunks):
            if ch.tier is Tier.GPU:
                self._evict_chunk(conv, i, True)
                if conv.chunks[i].tier is Tier.CPU:
                    self._entered_cpu(conv, i)
        self._gpu_index.discard(conv)
        self.stats.suspended_requests += 1
        req.cache_stats.suspended_requests += 1

    def _release(self, conv: Conversation) -> None:
        """A running conversation stops running (its chunks are all on the GPU)."""
        self._pinned_gpu -= len(conv.chunks)
        conv.running = False
        conv.block_table = ()

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
        """Free the blocks of chunks ``keep..`` and forget those chunks (of an idle
        conversation, or one being released)."""
        for i in range(keep, len(conv.chunks)):
            ch = conv.chunks[i]
            if ch.tier is Tier.GPU:
                self.gpu.free([ch.block])
            elif ch.tier is Tier.CPU and self.cpu is not None:
                self._cancel_swap_out(ch.block, conv.chunk_tokens(i, self.chunk_size))
                self.cpu.free([ch.block])
        del conv.chunks[keep:]
        conv.kv_end = min(conv.kv_end, keep * self.chunk_size)

    # ------------------------------------------------------------------ eviction index
    def _cost(self, context_len: int) -> float:
        """``chunk_cost``, memoised (it is a pure function of the context length)."""
        v = self._costs.get(context_len)
        if v is None:
            v = self._costs[context_len] = self.chunk_cost(context_len)
        return v

    def _key(self, conv: Conversation, i: int) -> EvictionKey:
        """Chunk ``i``'s key at ``t_e`` (a lower bound of its key at any ``now <= t_e``)."""
        return self.policy.key(conv, i, self._t_eval, self._cost, self.chunk_size)

    def _key_now(self, conv: Conversation, i: int) -> EvictionKey:
        """Chunk ``i``'s key now (during an eviction)."""
        return self.policy.key(conv, i, self._now, self._cost, self.chunk_size)

    def _refresh(self, now: float) -> None:
        """An eviction starts at ``now``. Keys evaluated at an earlier ``now`` are keyed at
        ``t_e`` again (they would not be lower bounds any more); all keys are re-evaluated at
        ``now + key_refresh_s`` once ``now`` passes ``t_e``."""
        if now == self._now:
            if len(self._exact) > self._exact_max + 2 * len(self._gpu_index.live):
                self._rebound()  # many evictions at one now: bounds again (still valid)
            return
        self._now = now
        if not self._time_dependent:
            return
        t_e = self._t_eval
        if not t_e - self.key_refresh_s <= now <= t_e:
            t_e = self._t_eval = now + self.key_refresh_s
            for index in (self._gpu_index, self._cpu_index):
                index.rekey({conv: self._key(conv, i) for conv, (i, _, _, _) in
                             index.live.items()}, t_e)
            self._exact.clear()
        else:
            self._rebound()

    def _rebound(self) -> None:
        """Entries keyed at ``now`` are keyed at ``t_e`` again (lower bounds)."""
        t_e = self._t_eval
        for index, conv in self._exact:
            entry = index.live.get(conv)
            if entry is not None and entry[3] != t_e:
                index.set(conv, entry[0], self._key(conv, entry[0]), t_e)
        self._exact.clear()

    def _first(self, conv: Conversation, tier: Tier, start: int) -> int | None:
        """The first chunk in ``tier`` from ``start`` on, in the policy's chunk order."""
        chunks = conv.chunks
        if self._step > 0:
            for i in range(max(start, 0), len(chunks)):
                if chunks[i].tier is tier:
                    return i
        else:
            for i in range(min(start, len(chunks) - 1), -1, -1):
                if chunks[i].tier is tier:
                    return i
        return None

    def _start(self, conv: Conversation) -> int:
        return 0 if self._step > 0 else len(conv.chunks) - 1

    def _advance(self, index: _TierIndex, tier: Tier, conv: Conversation, start: int) -> None:
        """The conversation's candidate in ``tier`` is its first chunk there from ``start``."""
        i = self._first(conv, tier, start)
        if i is None:
            index.discard(conv)
        else:
            index.set(conv, i, self._key(conv, i), self._t_eval)

    def _index(self, conv: Conversation) -> None:
        """(Re)index an idle conversation from scratch (its chunks or its key changed)."""
        self._advance(self._gpu_index, Tier.GPU, conv, self._start(conv))
        self._advance(self._cpu_index, Tier.CPU, conv, self._start(conv))

    def _unindex(self, conv: Conversation) -> None:
        self._gpu_index.discard(conv)
        self._cpu_index.discard(conv)

    def _entered_cpu(self, conv: Conversation, i: int) -> None:
        """Chunk ``i`` of an idle conversation just reached the CPU tier."""
        entry = self._cpu_index.live.get(conv)
        if entry is None or (i - entry[0]) * self._step < 0:
            self._cpu_index.set(conv, i, self._key(conv, i), self._t_eval)

    def _peek_victim(self, tier: Tier) -> Victim | None:
        """The idle chunk of lowest key in ``tier`` now (during an eviction at ``_now``).

        Entries keyed at ``t_e`` hold lower bounds: while the lowest entry is one, it is keyed
        again at ``now`` (exact) and goes back in the heap; once the lowest is exact, no other
        chunk's key can be lower."""
        index = self._gpu_index if tier is Tier.GPU else self._cpu_index
        if not self._time_dependent:
            return index.peek()
        now = self._now
        while (top := index.peek()) is not None:
            _, conv, i = top
            if index.live[conv][3] == now:
                return top
            index.replace_top(conv, i, self._key_now(conv, i), now)
            self._exact.append((index, conv))
        return None

    # ------------------------------------------------------------------ eviction
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

        The hot loop of the cache: one pass per chunk, the victim's next GPU chunk replacing it
        at the top of the GPU index (one sift)."""
        self._refresh(now)
        whole = self.policy.whole_conversation
        gpu_index, cpu_index = self._gpu_index, self._cpu_index
        step, c = self._step, self.chunk_size
        gpu, cpu, stats, plan = self.gpu, self.cpu, self.stats, self._plan
        gpu_tier, cpu_tier = Tier.GPU, Tier.CPU
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
            chunks = conv.chunks
            ch = chunks[i]
            tokens = min(c, conv.kv_end - i * c)
            cpu_block = -1
            if cpu is not None:
                if cpu.num_free_blocks:
                    cpu_block = cpu.allocate_one()
                else:
                    victim = self._peek_victim(cpu_tier)
                    if victim is not None and not key < victim[0]:
                        self._drop_cpu_victim(victim[1], victim[2])
                        cpu_block = cpu.allocate_one()
            if cpu_block < 0:
                gpu.free_one(ch.block)
                ch.tier, ch.block = Tier.DROPPED, -1
                stats.dropped_tokens += tokens
            else:
                if urgent:
                    plan.swap_out_first[cpu_block] = ch.block
                    gpu.free_one(ch.block)
                else:
                    plan.swap_out[cpu_block] = ch.block
                ch.tier, ch.block = cpu_tier, cpu_block
                stats.swapped_out_tokens += tokens
            # the conversation's next GPU chunk takes its place in the GPU index
            j = self._first(conv, gpu_tier, i + step)
            if j is None:
                gpu_index.pop_top(conv)
            else:  # keyed now (exact, for this eviction); at t_e again when time moves
                gpu_index.replace_top(conv, j, self._key_now(conv, j), now)
                exact.append((gpu_index, conv))
            if cpu_block >= 0:  # chunk i reached the CPU: the CPU index's cursor moves back?
                entry = cpu_index.live.get(conv)
                if entry is None or (i - entry[0]) * step < 0:
                    cpu_index.set(conv, i, key, now)
                    exact.append((cpu_index, conv))
            done += 1
            last = conv
        return done

    def _evict_chunk(self, conv: Conversation, i: int, urgent: bool) -> None:
        """One GPU chunk leaves the GPU outside an eviction pass (a suspension): to a CPU block
        if the tier has or can make room. The caller updates the conversation's index."""
        ch = conv.chunks[i]
        tokens = conv.chunk_tokens(i, self.chunk_size)
        cpu_block = self._cpu_block_for(conv, i)
        if cpu_block is None:
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
        return cpu.allocate_one()

    def _drop_cpu_victim(self, conv: Conversation, i: int) -> None:
        """Drop the CPU tier's lowest chunk (its entry is the CPU index's top)."""
        self.stats.dropped_tokens += conv.chunk_tokens(i, self.chunk_size)
        self._drop_cpu_chunk(conv, i)
        j = self._first(conv, Tier.CPU, i + self._step)
        if j is None:
            self._cpu_index.pop_top(conv)
        else:
            self._cpu_index.replace_top(conv, j, self._key_now(conv, j), self._now)
            if self._time_dependent:
                self._exact.append((self._cpu_index, conv))

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

    def _count(self, req: Request, st: CacheStats) -> None:
        self.stats.add(st)
        req.cache_stats.add(st)

    # ------------------------------------------------------------------ audit
    def check_integrity(self) -> None:
        """Raise AssertionError if any block or chunk is accounted for twice or not at all, or
        if the eviction index or a running count differs from a full recomputation."""
        groups = [b for g in self._reclaim_groups for b in g]
        assert self._reclaim_group_blocks == len(groups), "reclaim group count"
        self._check_pool(self.gpu, Tier.GPU, groups + list(self._plan.swap_out.values()))
        if self.cpu is not None:
            self._check_pool(self.cpu, Tier.CPU, self._reclaim_cpu)
        pinned = 0
        for conv in self.conversations.values():
            n = len(conv.chunks)
            if conv.running:
                assert all(ch.tier is Tier.GPU for ch in conv.chunks), conv.conversation_id
                assert conv.block_table == tuple(ch.block for ch in conv.chunks), (
                    conv.conversation_id)
                pinned += n
            else:
                assert n == cdiv(conv.kv_end, self.chunk_size), (conv.conversation_id, n)
                assert not conv.block_table, conv.conversation_id
            for ch in conv.chunks:
                assert (ch.block >= 0) == (ch.tier is not Tier.DROPPED), ch
        assert pinned == self._pinned_gpu, f"pinned GPU blocks {self._pinned_gpu} != {pinned}"
        self._check_index(self._gpu_index, Tier.GPU)
        self._check_index(self._cpu_index, Tier.CPU)

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

    def _check_index(self, index: _TierIndex, tier: Tier) -> None:
        want: dict[Conversation, int] = {}
        for conv in self.conversations.values():
            i = None if conv.running else self._first(conv, tier, self._start(conv))
            if i is not None:
                want[conv] = i
        got = {conv: i for conv, (i, _, _, _) in index.live.items()}
        assert got == want, f"{tier} index: {len(got)} candidates, want {len(want)}"
        heap = {seq: (key, conv, i) for key, seq, conv, i in index.heap}
        exact = {id(c) for x, c in self._exact if x is index}
        for conv, (i, seq, key, t) in index.live.items():
            cid = conv.conversation_id
            assert self.conversations.get(cid) is conv, cid
            assert key == self.policy.key(conv, i, t, self._cost, self.chunk_size), (
                tier, cid, i, "stale key")
            assert heap.get(seq) == (key, conv, i), (tier, cid, "not in heap")
            if self._time_dependent:  # a lower bound (at t_e), or exact now and listed
                assert t == self._t_eval or (t == self._now and id(conv) in exact), (
                    tier, cid, t, "keyed at neither t_e nor now")
