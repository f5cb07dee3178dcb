"""The two-tier KV cache: every conversation's chunks on the GPU, on the CPU, or dropped.

Owns two block pools (GPU and CPU), the conversations, and the copies each step needs. The
scheduler asks it to *admit* a turn (bring the conversation's chunks to the GPU: swap CPU
chunks in or recompute them, plan recomputation of dropped ones, add blocks for new tokens), to
*grow* a running turn, to *suspend* or *end* one. Room is made by evicting chunks of idle
conversations in the order of an :class:`~pensieve.core.eviction.EvictionPolicy`.

The cache is composed of two parts it holds and calls: :attr:`TieredKVCache.index`, an
:class:`~pensieve.core.eviction_index.EvictionIndex` that keeps, per tier, the idle chunks in
the policy's order (and explains how time-dependent keys stay exact), and
:attr:`TieredKVCache.store`, the :class:`~pensieve.core.kv_store.KVStore`, every block's owner:
the block pools, the block map of shared blocks, the disk tier's index, each step's copy
plan, lazy reclaiming of background swap-outs and the eviction passes (they pick victims from
the same index). The cache itself owns the conversations and their turns (admission, growth,
suspension, the end of a turn) and the audit::

    TieredKVCache --- conversations: dict[str, Conversation]
       |    |
       |    +-- store: KVStore --- gpu, cpu: BlockPool; blocks: BlockMap; disk: DiskIndex;
       |                   |       the step's plan; reclaim groups
       +-- index: EvictionIndex <-+  (one object; both parts hold it; it reads the block map)

Swap or recompute (``swap_chunk_s``). A CPU chunk of an admitted turn is brought back by a
swap-in, or, when that is expected to take longer, recomputed (its CPU block freed, its
positions pending like a dropped chunk's). The two ways use different resources that run side
by side: the copy stream, which serves copies in order, and the GPU's compute. A chunk goes to
the one that would have it sooner given what that resource already has this step (greedy list
scheduling on two machines): swap when ``swap_chunk_s * (1 + queued) <= step_overlap_s +
recompute_s + chunk_cost(l)``, where ``queued`` counts the chunk copies already on the stream
this step (urgent swap-outs and swap-ins planned so far, plus background swap-outs still in
flight as last reported), ``recompute_s`` the recomputation planned so far this step (dropped
chunks and chunks already chosen for recomputation) and ``step_overlap_s`` the step's other
compute, which the copies run beside (the engine keeps it at its recent decode-only step time;
0 until it has one). So copies that end within the step's own compute are taken, and a stream
busy with swap-outs (thrash) pushes chunks toward recomputation, until both finish about
together. Without ``step_overlap_s`` the rule would recompute chunks whose copies hide behind
the batch's decodes anyway, and spend the compute every request of the step waits for: in the
simulator that was ~2.5x the prefill tokens on ShareGPT near saturation. Recomputation is
only chosen for chunks that fit the step's token budget (the scheduler passes what is left), so
it never delays a turn by a step; with ``swap_chunk_s = None`` every CPU chunk is swapped in.

Shared prefixes (``share_prefixes``, :mod:`pensieve.core.block_map`): a turn's full chunks
equal to a registered block's take a reference to it at admission instead of being
computed (:meth:`pending_for` leaves them out), and an ended turn registers its own.

Invariants (:meth:`check_integrity`): each GPU and CPU block is free, held by exactly one chunk
of its tier (a registered GPU block: by as many as its references), or waiting to be
reclaimed, never two of these; each chunk is in exactly one tier;
a running conversation has all its chunks on the GPU; an idle one has ``cdiv(kv_end, C)``; the
eviction index and the running counts equal a full recomputation.
"""

from __future__ import annotations

import math

from pensieve.core.block_map import BlockMap, Found, request_hashes
from pensieve.core.cache_config import CacheConfig
from pensieve.core.conversation import Conversation, Tier
from pensieve.core.disk_index import DiskIndex
from pensieve.core.disk_restore import extend_from_disk, restore_from_disk
from pensieve.core.eviction import ChunkCost, EvictionPolicy
from pensieve.core.eviction_index import EvictionIndex
from pensieve.core.kv_store import KVStore
from pensieve.core.outputs import DiskPlan, SwapPlan
from pensieve.core.request import Request
from pensieve.core.stats import CacheStats
from pensieve.core.write_ahead import write_ahead

Interval = tuple[int, int]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pending_ranges(req: Request, conv: Conversation, dropped: list[int], num_ext: int,
                   chunk_size: int) -> list[tuple[int, int]]:
    """The positions the turn must compute, ascending ``[lo, hi)`` ranges: the chunks
    ``dropped`` (ascending; dropped ones not taken from shared blocks), then everything from
    ``kv_end`` (or from ``num_ext`` leading chunks a conversation without KV takes from
    shared blocks)."""
    c = chunk_size
    holes: list[tuple[int, int]] = []
    for i in dropped:
        lo, hi = i * c, min((i + 1) * c, conv.kv_end)
        if holes and holes[-1][1] == lo:
            holes[-1] = (holes[-1][0], hi)
        else:
            holes.append((lo, hi))
    kv_end = num_ext * c if num_ext else conv.kv_end
    tail = (min(kv_end, req.num_tokens - 1), req.num_tokens)
    if holes and holes[-1][1] == tail[0]:
        holes[-1] = (holes[-1][0], tail[1])
    else:
        holes.append(tail)
    return holes


class TieredKVCache:
    """Every conversation's chunk map over the GPU and CPU tiers, and its turns; the blocks are
    its :attr:`store`'s, the eviction order its :attr:`index`'s (module docstring)."""

    index_class: type[EvictionIndex] = EvictionIndex
    """The index the cache builds (a test substitutes one that checks every choice)."""
    store_class: type[KVStore] = KVStore
    """The store the cache builds (likewise)."""

    def __init__(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        chunk_cost: ChunkCost,
        config: CacheConfig,
        *,
        policy: EvictionPolicy | None = None,
        swap_chunk_s: float | None = None,
        swap_out_batch: float = 0.05,
        key_refresh_s: float = 0.5,
        disk: DiskIndex | None = None,
    ) -> None:
        """A cache of ``num_gpu_blocks`` and ``num_cpu_blocks`` chunks built from ``config``
        whole (:class:`~pensieve.core.cache_config.CacheConfig`: its chunk size, thresholds,
        sharing, tenant share and admission deferral, each option's one default there).
        ``policy``: another policy than ``config.policy`` (an engine reset, or one that has
        no name). ``swap_chunk_s``: seconds to move one chunk (all layers) one way between
        the tiers at the measured rate; with it, admission recomputes a CPU chunk instead of
        swapping it in when that is expected to be sooner (see the module docstring); None:
        always swap in. ``key_refresh_s``: how far ahead (seconds) time-dependent eviction
        keys are evaluated, i.e. how often at most the whole index is re-keyed; the eviction
        order is exact whatever its value (see :mod:`pensieve.core.eviction_index`).
        ``disk``: the disk tier's index below the CPU tier (None: none)."""
        policy = config.policy if policy is None else policy
        self.conversations: dict[str, Conversation] = {}
        if disk is not None:
            disk.bind(self.conversations)
        chunk_size, swap_out_threshold = config.chunk_size, config.swap_out_threshold
        decode_reserve, tenant_kv_share = config.decode_reserve, config.tenant_kv_share
        defer_admission, share_prefixes = config.defer_admission, config.share_prefixes
        share_across_tenants = config.share_prefixes_across_tenants
        if swap_chunk_s is not None and not (swap_chunk_s >= 0.0 and math.isfinite(swap_chunk_s)):
            raise ValueError(f"swap_chunk_s must be a finite time >= 0, got {swap_chunk_s}")
        blocks = BlockMap(num_gpu_blocks, num_cpu_blocks, chunk_size) if share_prefixes else None
        self.index = self.index_class(self.conversations, chunk_size, policy, chunk_cost,
                                      key_refresh_s, blocks)
        self.store = self.store_class(num_gpu_blocks, num_cpu_blocks, self.index,
                                      swap_out_threshold, decode_reserve, swap_out_batch,
                                      tenant_kv_share, blocks, disk)
        self.chunk_size = chunk_size
        self.policy = policy
        self.chunk_cost = chunk_cost
        # the parts' objects, named here for the scheduler, the engine and the tests
        self.gpu = self.store.gpu
        self.cpu = self.store.cpu
        self.blocks = blocks
        """The store's block map of shared blocks (None: prefixes are not shared)."""
        self.stats = self.store.stats
        self.tenant_share = self.store.tenant_share
        self.decode_reserve_blocks = self.store.decode_reserve_blocks
        self.swap_chunk_s = swap_chunk_s
        self.share_across_tenants = share_across_tenants
        """Requests' share salts leave out their tenant (``core.prefix_share.share_salt``)."""
        self.defer_admission = defer_admission
        """Steps a turn short of GPU blocks may wait for background swap-outs to free them
        (instead of urgent swap-outs that the whole step waits for); 0: never."""
        self.step_overlap_s = 0.0
        """Seconds of a step's own compute that its copies run beside (module docstring): the
        recent decode-only step time the engine reports (:meth:`observe_decode_step`)."""
        self._step_recompute_s = 0.0
        """Recomputation planned this step (seconds of compute, by ``chunk_cost``)."""
        self._write_ahead_due = False  # the last write-ahead asked for another walk

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
        self.index.remove(conv)
        if self.blocks is not None:
            self.blocks.forget(conv)
        self.store.free_chunks(conv, 0)
        if self.disk is not None:
            self.disk.forget_from(conversation_id, 0)
        if self.tenant_share is not None:
            self.store.apply_hints(self.tenant_share.forget(conv))
        del self.conversations[conversation_id]

    def set_queued(self, conv: Conversation, queued_at: float | None) -> None:
        """A turn of ``conv`` now waits in the queue (since ``queued_at``), or no longer does
        (None); the policy's key reads it (``pensieve``: queued conversations go last)."""
        if conv.queued_at == queued_at:
            return
        conv.queued_at = queued_at
        self.index.rekey(conv)

    def set_hints(self, conv: Conversation, priority: float | None = None,
                  keep_alive_s: float | None = None, tenant: str | None = None) -> None:
        """Change the retention hints the policy's key reads (and the key with them), within
        the tenant's share of each tier when there is one."""
        p, k = conv.hints
        conv.hints = (p if priority is None else float(priority),
                      k if keep_alive_s is None else float(keep_alive_s))
        if tenant is not None:
            conv.tenant = tenant
        conv.priority, conv.keep_alive_s = conv.hints
        self.index.rekey(conv)
        self._count_share(conv)

    def _count_share(self, conv: Conversation) -> None:
        """Count ``conv`` in its tenant's share (its chunks changed or its hints did)."""
        share = self.tenant_share
        if share is None:
            return
        if conv.hints == (1.0, 0.0) or not conv.tenant:
            self.store.apply_hints(share.forget(conv))
        else:
            self.store.apply_hints(share.track(conv))

    def block_table(self, conv: Conversation) -> tuple[int, ...]:
        """GPU blocks of a running conversation, chunk by chunk."""
        if conv.running:
            return conv.block_table
        return tuple(c.block for c in conv.chunks)

    # ------------------------------------------------------------------ a step
    def observe_decode_step(self, seconds: float) -> None:
        """A decode-only step took ``seconds``: :attr:`step_overlap_s` follows a moving
        average over ~5 such steps (the first sets it)."""
        old = self.step_overlap_s
        self.step_overlap_s = seconds if old == 0 else old + 0.2 * (seconds - old)

    def begin_step(self) -> None:
        """Reclaim CPU blocks whose chunks were swapped in by the previous step (those swapped
        in ahead by the previous step: at the next one)."""
        self.store.begin_step()
        self._step_recompute_s = 0.0

    @property
    def disk(self) -> DiskIndex | None:
        """The disk tier below the CPU tier (:class:`~pensieve.core.disk_index.DiskIndex`),
        held by the store; None: none (given at construction)."""
        return self.store.disk

    @property
    def num_planned_swap_ins(self) -> int:
        """Chunks this step's plan swaps in so far (``SwapPlan.swap_in``)."""
        return self.store.num_planned_swap_ins

    def swap_in_ahead(self, since: int) -> int:
        """Move the swap-ins planned after the first ``since`` to ``SwapPlan.swap_in_ahead``
        (the turn that needs them computes from the next step on); returns how many."""
        return self.store.swap_in_ahead(since)

    @property
    def has_pending_swap_outs(self) -> bool:
        """Background swap-outs whose GPU blocks are not reclaimed yet (copies may run)."""
        return self.store.has_pending_swap_outs

    def take_swap_plan(self) -> SwapPlan:
        """This step's copies; its background swap-outs become a reclaim group."""
        return self.store.take_swap_plan()

    def hash_turn(self, req: Request) -> None:
        """Compute a queued turn's chunk hashes (its full chunks before its last token) once,
        off the step path, onto ``req.share_hashes``: admission, the disk tier's prefetch and
        the end of the turn take them from there. Nothing without sharing or a disk tier."""
        if self.blocks is None and self.disk is None:
            return
        cid = req.conversation_id
        conv = self.conversations.get(cid) if cid is not None else None
        request_hashes(req, conv, self.chunk_size, (req.num_tokens - 1) // self.chunk_size)

    def take_disk_plan(self) -> DiskPlan:
        """The disk reads, writes and deletes decided since the last call (empty without a
        disk tier): the step's :attr:`SchedulerOutput.disk`."""
        disk = self.disk
        return disk.take_plan() if disk is not None else DiskPlan()

    def reclaim_swap_outs(self, in_flight: int) -> None:
        """The runner reports ``in_flight`` background swap-out batches still copying: free
        the GPU blocks of every older one (:meth:`KVStore.reclaim_swap_outs`)."""
        self.store.reclaim_swap_outs(in_flight)

    def plan_background(self, now: float) -> None:
        """Ahead-of-time swap-out while free GPU blocks (counting those soon reclaimed) are
        under the threshold; with a disk tier, writes ahead of the CPU tier's next spills
        (:func:`~pensieve.core.write_ahead.write_ahead`)."""
        store = self.store
        if store.cpu is None:
            return
        short = (store.swap_out_threshold_blocks - store.gpu.num_free_blocks
                 - store.pending_reclaim_gpu())
        if short > 0:
            store.evict_gpu(short + store.swap_out_batch_blocks, now, urgent=False)
        if store.disk is not None:
            self._write_ahead_due = write_ahead(store, now, self._write_ahead_due)

    # ------------------------------------------------------------------ admitting a turn
    def pending_for(self, req: Request, conv: Conversation) -> list[Interval]:
        """Positions the turn must compute: dropped chunks, then everything from kv_end
        (less the chunks it would take from shared blocks, were it admitted now)."""
        if self.disk is not None:
            extend_from_disk(self.store, req, conv)  # no KV here, copies on disk (a restart)
        dropped = conv.dropped_chunks()
        if self.blocks is None:
            return pending_ranges(req, conv, dropped, 0, self.chunk_size)
        found, ext, cpu = self._find_shared(req, conv, dropped)
        if found or cpu:
            taken = {i for i, _ in found}.union(i for i, _ in cpu)
            dropped = [i for i in dropped if i not in taken]
        num_ext = len(ext) + sum(1 for i, _ in cpu if i >= len(conv.chunks))
        return pending_ranges(req, conv, dropped, num_ext, self.chunk_size)

    def admit(self, req: Request, conv: Conversation, first_end: int, now: float,
              spare_tokens: int | None = None, may_defer: bool = False) -> bool:
        """Pin the conversation on the GPU for this turn, with blocks up to ``first_end``.

        Returns False, changing nothing, when the GPU cannot make room while keeping the
        decode reserve free. On success sets ``req.pending`` and counts the turn's sources.
        ``spare_tokens``: tokens of this step's budget left beyond the turn's share (bounds
        CPU chunks chosen for recomputation; None: no bound). Positions so chosen join
        ``req.pending`` before ``first_end``, so the blocks up to ``first_end`` still suffice.
        ``may_defer``: other turns keep running, so with :attr:`defer_admission` a turn short
        of blocks may wait a step for background swap-outs instead of urgent ones (returns
        False then too; see :meth:`_defer`).
        """
        c = self.chunk_size
        chunks = conv.chunks
        store, blocks = self.store, self.blocks
        tiers = [ch.tier for ch in chunks]
        found, ext, cpu = (self._find_shared(req, conv, conv.dropped_chunks(tiers))
                           if blocks is not None else ([], [], []))
        on_gpu = tiers.count(Tier.GPU) + len(found) + len(ext)
        n_chunks = len(chunks) + len(ext) + sum(1 for i, _ in cpu if i >= len(chunks))
        need = n_chunks - on_gpu + max(0, cdiv(first_end, c) - n_chunks)
        shortfall = need + self.decode_reserve_blocks - self.gpu.num_free_blocks
        held = on_gpu  # of the evictable blocks, those this turn would pin
        if (shortfall > 0 and blocks is not None and blocks.gpu.num_pinned  # not evictable
                and store.evictable_gpu_blocks() - held < shortfall):  # else it fits anyway
            held -= blocks.pinned_by_others(chunks, tiers, found, ext)
        if shortfall > 0 and store.evictable_gpu_blocks() - held < shortfall:
            return False
        if shortfall > 0 and may_defer and self._defer(req, conv, shortfall, now):
            return False
        self.index.remove(conv)
        conv.running = True  # pinned: never its own victim
        conv.queued_at = None  # out of the index while running; ended turns re-index
        st = CacheStats()
        if found or ext or cpu:  # references before evicting: the blocks stay
            assert blocks is not None
            st.shared_hit_tokens = blocks.take(conv, found, ext, cpu, c)
        if shortfall > 0:
            store.evict_gpu(shortfall, now, urgent=True)
        if self.swap_chunk_s is not None and self.cpu is not None:
            st.cpu_recomputed_tokens = self._choose_recompute(conv, spare_tokens)
        store.drop_read_twice(conv)  # read by another swap-in of this step: recomputed
        if cpu:  # those still to be swapped in (not chosen for recomputation)
            st.cpu_shared_tokens = sum(conv.chunk_tokens(i, c) for i, b in cpu
                                       if chunks[i].tier is Tier.CPU and chunks[i].block == b)
        if self.disk is not None:
            st.disk_hit_tokens = restore_from_disk(self.store, req, conv)  # dropped -> CPU chunks
        req.pending = pending_ranges(req, conv, conv.dropped_chunks(), 0, c)
        hit, swapped, recomputed = store.pin(conv)
        st.gpu_hit_tokens += hit - st.shared_hit_tokens
        st.cpu_hit_tokens += swapped - st.disk_hit_tokens
        st.swapped_in_tokens += swapped
        st.recomputed_tokens += recomputed
        history_kv = max(len(conv.token_ids) - 1, 0)  # KV that existed after the last turn
        st.recomputed_tokens += max(0, history_kv - conv.kv_end)
        st.new_prompt_tokens += req.num_tokens - max(conv.kv_end, history_kv)
        self._extend(conv, first_end)
        self._count(req, st)
        return True

    def _find_shared(self, req: Request, conv: Conversation, dropped: list[int]) -> Found:
        """Registered blocks the turn can take (:meth:`BlockMap.find`): CPU slots that a
        background copy of this step writes are not taken."""
        assert self.blocks is not None
        return self.blocks.find(req, conv, dropped, self.chunk_size,
                                self.store.plan.swap_out if self.store.share_cpu else None)

    def _defer(self, req: Request, conv: Conversation, shortfall: int, now: float) -> bool:
        """Whether the turn waits for background swap-outs rather than evicting urgently:
        with :attr:`defer_admission` and a CPU tier, at most :attr:`defer_admission` times per
        turn. What the blocks being reclaimed will not cover is evicted now, in the background
        (the conversation itself kept out of the victims); the turn is admitted at a later
        step, once those copies are done, without the step waiting for them."""
        if self.cpu is None or req.deferrals >= self.defer_admission:
            return False
        req.deferrals += 1
        short = shortfall - self.store.pending_reclaim_gpu()
        if short > 0:
            self.index.remove(conv)
            conv.running = True  # out of the victims while the pass runs, as in admission
            self.store.evict_gpu(short, now, urgent=False)
            conv.running = False
            self.index.reindex(conv)
        return True

    def _choose_recompute(self, conv: Conversation, spare_tokens: int | None) -> int:
        """Turn the CPU chunks that are sooner recomputed than swapped in into dropped ones
        (module docstring); returns their tokens."""
        swap_s = self.swap_chunk_s
        assert swap_s is not None
        c = self.chunk_size
        chunks = conv.chunks
        recompute_s = self._step_recompute_s
        other = self.step_overlap_s
        cost_of = self.index.cost
        for i, ch in enumerate(chunks):
            if ch.tier is Tier.DROPPED or ch.tier is Tier.DISK:  # read back or recomputed
                recompute_s += cost_of(min((i + 1) * c, conv.kv_end))
        queued = self.store.queued_copies()
        spare = math.inf if spare_tokens is None else spare_tokens
        converted = 0
        for i, ch in enumerate(chunks):
            if ch.tier is not Tier.CPU:
                continue
            tokens = conv.chunk_tokens(i, c)
            cost = cost_of(min((i + 1) * c, conv.kv_end))
            if other + recompute_s + cost < swap_s * (1 + queued) and tokens <= spare:
                self.store.drop_cpu_chunk(conv, i)
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
        if shortfall > 0 and self.store.evict_gpu(shortfall, now, True) < shortfall:
            return False
        self._extend(conv, end)
        return True

    def _extend(self, conv: Conversation, end: int) -> None:
        """More GPU chunks for a running conversation, up to position ``end``."""
        self.store.extend(conv, cdiv(end, self.chunk_size) - len(conv.chunks))

    # ------------------------------------------------------------------ ending a turn
    def end_turn(self, req: Request, conv: Conversation, now: float) -> None:
        """The turn finished: record it in the history; keep, or free, its KV."""
        self.store.release(conv)
        self._settle(conv, req.pending, req.num_tokens)
        conv.token_ids = req.all_token_ids
        conv.last_active = now
        if conv.ephemeral:
            self.delete(conv.conversation_id)
            return
        if not self.policy.keeps_kv:
            self.store.free_chunks(conv, 0)
        if self.blocks is not None:
            self.gpu.free(self.blocks.register_turn(req, conv, self.chunk_size))
        self.index.reindex(conv)
        self._count_share(conv)

    def abort_turn(self, req: Request, conv: Conversation, now: float) -> None:
        """The turn is abandoned: the conversation stays as it was before it."""
        if conv.running:
            self.store.release(conv)
            self._settle(conv, req.pending, req.num_tokens)
        self._truncate(conv, min(conv.kv_end, len(conv.token_ids)))
        if conv.ephemeral:
            self.delete(conv.conversation_id)
        else:
            self.index.reindex(conv)
            self._count_share(conv)

    def suspend(self, req: Request, conv: Conversation, now: float) -> None:
        """Take a running turn off the GPU: its chunks go to the CPU (or are dropped)."""
        self.index.refresh(now)
        self.store.release(conv)
        self._settle(conv, req.pending, req.num_tokens)
        conv.last_active = now
        req.pending = []
        self.index.reindex(conv)  # idle: its chunks that reach the CPU compete there too
        self.store.move_out(conv)
        self._count_share(conv)
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
                    self.store.free_gpu_block(ch.block)
                ch.tier, ch.block = Tier.DROPPED, -1
        self._truncate(conv, kv_end)

    def _truncate(self, conv: Conversation, kv_end: int) -> None:
        """Set ``kv_end`` and free the chunks wholly past it."""
        conv.kv_end = kv_end
        keep = cdiv(kv_end, self.chunk_size)
        if self.disk is not None and len(conv.chunks) > keep:  # copies of chunks cut off
            self.disk.forget_from(conv.conversation_id, keep)
        self.store.free_chunks(conv, keep)

    def _count(self, req: Request, st: CacheStats) -> None:
        self.stats.add(st)
        req.cache_stats.add(st)

    # ------------------------------------------------------------------ audit
    def check_integrity(self) -> None:
        """Raise AssertionError if any block or chunk is accounted for twice or not at all, or
        if the eviction index or a running count differs from a full recomputation."""
        self.store.check()
        pinned: set[int] = set()  # a shared block once
        for conv in self.conversations.values():
            n = len(conv.chunks)
            if conv.running:
                assert all(ch.tier is Tier.GPU for ch in conv.chunks), conv.conversation_id
                assert conv.block_table == tuple(ch.block for ch in conv.chunks), (
                    conv.conversation_id)
                pinned.update(conv.block_table)
                blocks = self.blocks
                assert conv.pinned_shared == [b for b in conv.block_table if blocks is not None
                                              and blocks.gpu.refs_of(b)], conv.conversation_id
            else:
                assert n == cdiv(conv.kv_end, self.chunk_size), (conv.conversation_id, n)
                assert not conv.block_table and not conv.pinned_shared, conv.conversation_id
            disk = self.disk
            for i, ch in enumerate(conv.chunks):
                assert (ch.block >= 0) == (ch.tier is Tier.GPU or ch.tier is Tier.CPU), ch
                if ch.tier is Tier.DISK:  # its copy is the disk index's hold
                    assert disk is not None and disk.get(conv.conversation_id, i), (
                        conv.conversation_id, i)
            if self.disk is not None:
                for i in self.disk.entries.get(conv.conversation_id, {}):
                    assert i >= len(conv.chunks) or conv.chunks[i].tier is Tier.DISK, (
                        conv.conversation_id, i, conv.chunks[i])
        assert len(pinned) == self.store.pinned_gpu, (
            f"pinned GPU blocks {self.store.pinned_gpu} != {len(pinned)}")
        self.index.check()
