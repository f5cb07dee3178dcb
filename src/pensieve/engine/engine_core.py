"""EngineCore: requests, conversations and one step around an executor, without torch.

The engine is composed, not subclassed: a :class:`~pensieve.core.scheduler.Scheduler` (which
holds the :class:`~pensieve.core.tiered_cache.TieredKVCache`) and an
:class:`~pensieve.engine.executor.Executor` (local model runner, tensor-parallel ranks or the
simulator). :class:`~pensieve.engine.llm_engine.LLMEngine` and
:class:`~pensieve.sim.simulator.SimEngine` only assemble those pieces; they share, line for
line, how a turn enters the scheduler, how a step runs and what comes out of it.

One step: ``scheduler.schedule()`` -> ``executor.execute()`` (contained: a request whose
execution raises fails alone, :mod:`pensieve.engine.containment`) ->
``scheduler.update_from_output()`` -> a :class:`StepRecord` to every ``step_observers``
function (metrics, benchmarks, profilers attach there; nothing reassigns the engine's parts).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Protocol

from pensieve.core.outputs import (
    DiskPlan,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    SwapPlan,
    TokenLogprobs,
)
from pensieve.core.prefix_share import share_salt
from pensieve.core.request import Request, RequestStatus
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.scheduler import ConversationBusyError, Scheduler
from pensieve.core.scheduling_config import SchedulerConfig
from pensieve.core.tiered_cache import TieredKVCache
from pensieve.engine.containment import copied_chunks, execute_contained, restore_pending
from pensieve.engine.executor import Executor
from pensieve.engine.request_output import RequestOutput
from pensieve.engine.step_record import StepRecord, prefill_decode_tokens

StepObserver = Callable[[StepRecord], None]


class DiskHooks(Protocol):
    """The disk tier's I/O as the engine drives it (:class:`pensieve.engine.disk_tier.
    DiskTier`): reads started when a turn is added, collected before scheduling, the step's
    plan carried out before execution, ended turns' chunks written through to a shared store
    (``--kv-remote``) after it, everything written at shutdown."""

    apply_s: tuple[float, float, float]
    """The last ``apply``'s seconds: waiting for copies into the CPU tier, spills copied out,
    restores copied in."""

    def prefetch(self, conversation_id: str, tokens: list[int] | None = None,
                 salt: bytes = b"", dropped: list[int] | None = None,
                 hashes: list[bytes] | None = None,
                 cache: TieredKVCache | None = None) -> None: ...
    def collect(self, wait: bool = True) -> None: ...
    def apply(self, plan: DiskPlan, sync: Callable[[], None] | None = None) -> None: ...
    def publish(self, cache: TieredKVCache, finished: Iterable[Request]) -> None: ...
    def close(self, cache: TieredKVCache | None) -> None: ...
    def stats(self) -> dict[str, int]: ...


class EngineCore:
    """A scheduler (with its cache) and an executor, stepped together."""

    def __init__(self, scheduler: Scheduler, executor: Executor, *,
                 clock: Callable[[], float] = time.monotonic,
                 eos_token_ids: tuple[int, ...] = (), vocab_size: int | None = None,
                 observers: Iterable[StepObserver] = (), disk: DiskHooks | None = None,
                 disk_sync: Callable[[], None] | None = None) -> None:
        """``clock``: seconds for arrivals, idle times and token timestamps (a benchmark's
        virtual or wall clock). ``vocab_size``: if given, prompt token ids are checked
        against it. ``observers``: called with every step's :class:`StepRecord`. ``disk``:
        the disk tier's I/O, whose index the cache was built with (None: none);
        ``disk_sync``: waits for copies in flight into the CPU tier before it touches them."""
        _check_fits(scheduler, executor)
        self.executor = executor
        self.now = clock
        """Source of ``now`` for arrivals, idle times and token timestamps (seconds)."""
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = vocab_size
        self.scheduler = scheduler
        self.num_steps = 0
        self.last_sampled: dict[str, int] = {}
        """Tokens sampled in the last step, by request id (for streaming)."""
        self.last_logprobs: dict[str, TokenLogprobs] = {}
        """Log-probabilities of the last step's tokens, by request id, for the requests that
        ask for them (for streaming)."""
        self.split_range_requests = 0
        """Requests computed as two or more ranges in one step (dropped leading chunks
        recomputed together with the new prompt)."""
        self.failed_requests = 0
        """Requests failed by a step whose execution raised on them (containment)."""
        self.audit = False
        """Check the cache's block accounting after every scheduling step (tests)."""
        self.track_step_overlap = True
        """Keep the cache's ``step_overlap_s`` at the recent decode-only step time (off: it
        stays where it is, 0 unless set; the swap-or-recompute rule before it was counted)."""
        self.disk = disk
        """The disk tier's I/O (None: no disk tier); its index is the cache's ``disk``."""
        self.disk_sync = disk_sync
        """Waits for copies in flight into the CPU tier before disk I/O touches it (CUDA)."""
        self.step_observers: list[StepObserver] = list(observers)
        """Called with a :class:`StepRecord` after every executed step (metrics, benchmarks)."""

    @property
    def cache(self) -> TieredKVCache:
        return self.scheduler.cache

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return self.scheduler.config

    def replace_scheduler(self, scheduler: Scheduler) -> None:
        """Start over with ``scheduler`` and its cache (empty tiers of the executor's sizes);
        turns in flight are aborted first, the step counters restart."""
        _check_fits(scheduler, self.executor)
        for rid in list(self.scheduler.requests):
            self.scheduler.abort_request(rid, self.now())
        self.scheduler = scheduler
        self.split_range_requests = 0
        self.num_steps = 0

    def shutdown(self) -> None:
        """Write what the disk tier should keep, then release the executor's processes and
        devices (idempotent)."""
        if self.disk is not None:
            disk, self.disk = self.disk, None
            if self.disk_sync is not None:
                self.disk_sync()
            disk.close(self.cache)
        self.executor.shutdown()

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None,
                    conversation_id: str | None = None, tenant: str = "",
                    cache_salt: str | None = None) -> None:
        """Queue a request. With a ``conversation_id`` the prompt is the *new* turn's input: the
        context is the conversation's history followed by it. ``tenant`` and ``cache_salt``
        salt its chunk hashes: only requests of equal salts share prefixes
        (:func:`~pensieve.core.prefix_share.share_salt`)."""
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: empty prompt")
        hi = self.vocab_size
        bad = [t for t in prompt_token_ids
               if not (isinstance(t, int) and 0 <= t and (hi is None or t < hi))]
        if bad:
            raise ValueError(
                f"request {request_id}: token ids out of range [0, {hi}): {bad[:5]}")
        bad_bias = [t for t, _ in params.logit_bias if hi is not None and t >= hi]
        if bad_bias:
            raise ValueError(f"logit_bias token ids out of range [0, {hi}): {bad_bias[:5]}")
        context = list(prompt_token_ids)
        if conversation_id is not None:
            conv = self.cache.conversations.get(conversation_id)
            if conv is not None:
                context = conv.token_ids + context
        req = Request(request_id, context, params,
                      arrival_time=self.now() if arrival_time is None else arrival_time,
                      eos_token_ids=self.eos_token_ids, conversation_id=conversation_id,
                      share_salt=share_salt(tenant, cache_salt,
                                            self.scheduler.cache.share_across_tenants))
        self.scheduler.add_request(req)
        if self.disk is not None and conversation_id is not None:
            conv = self.cache.conversations.get(conversation_id)
            dropped = conv.dropped_chunks() if conv is not None and conv.chunks else None
            self.disk.prefetch(conversation_id, req.all_token_ids, req.share_salt,
                               dropped, req.share_hashes, self.cache)  # read while it waits

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id, self.now())

    def finish_request(self, request_id: str) -> None:
        """End a turn now as if it had stopped on a token (a stop string matched on its text):
        its tokens so far become the conversation's history and their KV is kept. A turn that
        is not running (waiting, or suspended mid-decode) is aborted instead: its
        conversation stays as before it. No-op for a finished or unknown request."""
        if not self.scheduler.finish_request(request_id, self.now()):
            self.scheduler.abort_request(request_id, self.now())

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_waiting_tokens(self) -> int:
        """Prompt tokens the engine's turns still have to compute: the running turns' pending
        positions, and each queued turn's positions past its conversation's KV here. An
        estimate for a queued turn: positions its admission will take from a lower tier, the
        shared tier or a shared prefix count, its dropped chunks do not. The load the
        replicas' router spills on with a shared KV tier
        (:func:`pensieve.core.routing.spill_route`)."""
        sched = self.scheduler
        n = sum(r.num_pending for r in sched.running)
        convs = self.cache.conversations
        for req in sched.waiting:
            conv = convs.get(req.conversation_id) if req.conversation_id is not None else None
            kv = conv.kv_end if conv is not None else 0
            n += req.num_tokens - min(kv, req.num_tokens - 1)
        return n

    # ---------------------------------------------------------------- conversations
    def conversation_history(self, conversation_id: str) -> list[int]:
        """Every token of the conversation's completed turns (empty if unknown)."""
        conv = self.cache.conversations.get(conversation_id)
        return list(conv.token_ids) if conv is not None else []

    def delete_conversation(self, conversation_id: str) -> None:
        """Free the conversation's KV in both tiers and forget its history (no-op if unknown)."""
        if conversation_id in self.scheduler.busy_conversations:
            raise ConversationBusyError(f"conversation {conversation_id!r} has a turn running")
        self.cache.delete(conversation_id)

    def restore_conversation(self, conversation_id: str, token_ids: list[int]) -> None:
        """Give a conversation its history without KV (after a restart: recomputed on use)."""
        if conversation_id in self.scheduler.busy_conversations:
            raise ConversationBusyError(f"conversation {conversation_id!r} has a turn running")
        conv = self.cache.conversation(conversation_id)
        if not conv.token_ids:
            conv.token_ids = list(token_ids)

    def set_conversation_hints(self, conversation_id: str, priority: float | None = None,
                               keep_alive_s: float | None = None,
                               tenant: str | None = None) -> None:
        """Retention hints: a higher priority or a keep-alive window keeps its KV longer (up
        to the tenant's share of each tier, with ``tenant_kv_share``)."""
        if priority is not None and not priority > 0:
            raise ValueError(f"priority must be > 0, got {priority}")
        if keep_alive_s is not None and keep_alive_s < 0:
            raise ValueError(f"keep_alive_s must be >= 0, got {keep_alive_s}")
        self.cache.set_hints(self.cache.conversation(conversation_id), priority, keep_alive_s,
                             tenant)

    # ---------------------------------------------------------------- a step
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update; returns the requests that finished in this step, those
        that failed in it included (``finish_reason="error"``, :attr:`RequestOutput.error`)."""
        self.last_sampled = {}
        self.last_logprobs = {}
        t0 = time.perf_counter()
        if self.disk is not None:  # waits for reads only when no request runs
            self.disk.collect(wait=not self.scheduler.running)
        ts = time.perf_counter()
        sched = self.scheduler.schedule(self.now())
        ta = time.perf_counter()
        if self.disk is not None:
            self.disk.apply(sched.disk, self.disk_sync)
        t1 = time.perf_counter()
        if sched.is_empty and not self.cache.has_pending_swap_outs:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress: KV cache too small for a request")
            return []
        # An empty step while background swap-outs are still copying runs too: the runner
        # waits for the copies and reports them done, and their GPU blocks are reclaimed.
        if self.audit:
            self.cache.check_integrity()
        self.split_range_requests += sum(len(s.ranges) > 1 for s in sched.requests)
        t2, c2 = time.perf_counter(), self.now()
        step = execute_contained(self.executor.execute, sched)
        result = step.output
        t3 = time.perf_counter()
        self._observe_step_time(sched, self.now() - c2)
        self.scheduler.observe_step(t3 - t2, *prefill_decode_tokens(sched))
        failed = self._fail(sched.requests, step.failed, sched.swaps) if step.failed else []
        self.last_sampled = result.sampled_token_ids
        self.last_logprobs = result.logprobs
        self._append_logprobs(sched.requests, result)
        finished = self.scheduler.update_from_output(sched, result, self.now())
        if self.disk is not None and finished:  # write-through to a shared store, if any
            self.disk.publish(self.cache, finished)
        if self.step_observers:
            rec = StepRecord.of(sched, result, t1 - t0, t3 - t2, time.perf_counter() - t3,
                                failed_requests=len(failed), disk_wait_s=ts - t0,
                                disk_apply_s=t1 - ta, disk_parts=self.disk.apply_s
                                if self.disk is not None else (0.0, 0.0, 0.0))
            for observe in self.step_observers:
                observe(rec)
        if self.audit:
            self.cache.check_integrity()
        self.num_steps += 1
        return failed + [_output(r) for r in finished]

    def _observe_step_time(self, sched: SchedulerOutput, seconds: float) -> None:
        """Report a decode-only step's time, on the engine's clock, to the cache: its
        ``step_overlap_s`` (the compute a step's copies run beside, which its swap-or-recompute
        choice weighs) follows them (:meth:`TieredKVCache.observe_decode_step`)."""
        if not self.track_step_overlap or not sched.requests or seconds <= 0:
            return
        if prefill_decode_tokens(sched)[0]:
            return  # a step with prefill: longer than the compute a step always has
        self.cache.observe_decode_step(seconds)

    def _append_logprobs(self, scheduled: Iterable[ScheduledRequest],
                         result: RunnerOutput) -> None:
        """One entry per sampled token of the requests that ask (before the scheduler
        appends the tokens, which may finish the request and let it go)."""
        for s in scheduled:
            if s.sample and s.sampling_params.logprobs is not None:
                req = self.scheduler.requests.get(s.request_id)
                if (req is not None and req.status is RequestStatus.RUNNING
                        and s.request_id in result.sampled_token_ids):
                    req.logprobs.append(result.logprobs.get(s.request_id))
        for rid, scored in result.prompt_logprobs.items():
            req = self.scheduler.requests.get(rid)
            if req is not None:
                req.prompt_logprobs.update(p for p in scored if p[0] < len(req.prompt_token_ids))

    def _fail(self, scheduled: Iterable[ScheduledRequest], errors: dict[str, str],
              swaps: SwapPlan | None = None) -> list[RequestOutput]:
        """Abort the requests a step failed on: the positions it took are pending again (their
        KV is not known to be computed), and so are the chunks the step's swap-ins were to
        fill (a block that a failed step's copy was to fill is freed, not kept), so the
        conversation is left as before the turn, with only KV known to be written."""
        outs: list[RequestOutput] = []
        copied = {gpu for _, gpu in swaps.swap_in} if swaps is not None else set()
        for s in scheduled:
            req = self.scheduler.requests.get(s.request_id)
            if s.request_id not in errors or req is None:
                continue
            unsure = copied_chunks(s.block_table, copied, self.cache.chunk_size,
                                   req.num_tokens)
            req.pending = restore_pending(req.pending, s.ranges, unsure)
            self.scheduler.abort_request(s.request_id, self.now())
            out = _output(req)
            out.finish_reason = "error"
            out.error = errors[s.request_id]
            outs.append(out)
        self.failed_requests += len(outs)
        return outs

    def cache_stats(self) -> dict[str, int]:
        """:meth:`counters`, and ``waiting_tokens`` now (:attr:`num_waiting_tokens`: a pass
        over the running and queued turns, so not part of every step's snapshot)."""
        out = self.counters()
        out["waiting_tokens"] = self.num_waiting_tokens  # a gauge: the replicas' router reads it
        return out

    def counters(self) -> dict[str, int]:
        """Totals since start: token sources, swaps (bytes, all ranks), drops, suspensions,
        failed requests, blocks in use; ``defer_admission``, the setting (so that a run's
        saved metrics say what it ran with). What the server's snapshot after every step
        carries: none of it grows with the number of requests."""
        out = self.cache.stats.as_dict()
        out["split_range_requests"] = self.split_range_requests
        out["failed_requests"] = self.failed_requests
        out.update(self.executor.stats())
        if self.disk is not None:
            out.update(self.disk.stats())
        blocks = self.cache.blocks
        out["shared_blocks"] = blocks.gpu.num if blocks is not None else 0
        out["shared_block_refs"] = blocks.gpu.num_refs if blocks is not None else 0
        out["gpu_blocks_total"] = self.cache.gpu.num_blocks
        out["gpu_blocks_free"] = self.cache.gpu.num_free_blocks
        cpu = self.cache.cpu
        out["cpu_blocks_total"] = cpu.num_blocks if cpu is not None else 0
        out["cpu_blocks_free"] = cpu.num_free_blocks if cpu is not None else 0
        out["kv_block_bytes"] = self.executor.tiers.block_bytes
        out["defer_admission"] = self.cache.defer_admission  # a setting, for the record
        return out


def _output(r: Request) -> RequestOutput:
    return RequestOutput(r.request_id, r.prompt_token_ids, r.output_token_ids, r.finish_reason,
                         arrival_time=r.arrival_time, first_token_time=r.first_token_time,
                         finish_time=r.finish_time, conversation_id=r.conversation_id,
                         cache_stats=r.cache_stats.as_dict(), logprobs=list(r.logprobs),
                         prompt_logprobs=[r.prompt_logprobs.get(p) for p in
                                          range(len(r.prompt_token_ids))]
                         if r.sampling_params.prompt_logprobs is not None else [])


def _check_fits(scheduler: Scheduler, executor: Executor) -> None:
    """The cache's block ids must index the executor's tiers."""
    cache, tiers = scheduler.cache, executor.tiers
    cpu = cache.cpu.num_blocks if cache.cpu is not None else 0
    if cache.gpu.num_blocks > tiers.num_gpu_blocks or cpu > tiers.num_cpu_blocks:
        raise ValueError(f"a cache of {cache.gpu.num_blocks} GPU and {cpu} CPU blocks does "
                         f"not fit the executor's tiers {tiers}")
