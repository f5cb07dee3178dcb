"""EngineCore: requests, conversations and one step around an executor, without torch.

Both the real engine (:class:`~pensieve.engine.llm_engine.LLMEngine`, whose executor is the
model runner) and the simulator (:class:`~pensieve.bench.simulator.SimEngine`, whose executor
advances virtual time by a step-cost model) are an EngineCore: they share, line for line, how a
turn enters the scheduler, how a step runs and what comes out of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pensieve.core.config import SchedulerConfig
from pensieve.core.outputs import RunnerOutput, SchedulerOutput
from pensieve.core.request import Request
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.scheduler import ConversationBusyError, Scheduler
from pensieve.core.tiered_cache import TieredKVCache
from pensieve.engine.outputs import RequestOutput
from pensieve.engine.step_record import StepRecord


class EngineCore:
    """Subclasses call :meth:`_init_core` and implement :meth:`_execute`."""

    cache: TieredKVCache
    scheduler: Scheduler

    def _init_core(self, scheduler_config: SchedulerConfig, cache: TieredKVCache,
                   now: Callable[[], float], eos_token_ids: tuple[int, ...],
                   vocab_size: int | None) -> None:
        self.scheduler_config = scheduler_config
        self.now = now
        """Source of ``now`` for arrivals, idle times and token timestamps (seconds)."""
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self._install(cache)
        self.num_steps = 0
        self.last_sampled: dict[str, int] = {}
        """Tokens sampled in the last step, by request id (for streaming)."""
        self.split_range_requests = 0
        """Requests computed as two or more ranges in one step (dropped leading chunks
        recomputed together with the new prompt)."""
        self.audit = False
        """Check the cache's block accounting after every scheduling step (tests)."""
        self.step_observers: list[Callable[[StepRecord], None]] = []
        """Called with a :class:`StepRecord` after every executed step (metrics, benchmarks)."""

    def _install(self, cache: TieredKVCache) -> None:
        """Start over with ``cache`` (empty tiers) and a new scheduler; in-flight turns are
        aborted first."""
        old = getattr(self, "scheduler", None)
        if old is not None:
            for rid in list(old.requests):
                old.abort_request(rid, self.now())
        self.cache = cache
        self.scheduler = Scheduler(self.scheduler_config, cache)
        self.split_range_requests = 0
        self.num_steps = 0

    def _execute(self, sched: SchedulerOutput) -> RunnerOutput:
        raise NotImplementedError

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None,
                    conversation_id: str | None = None) -> None:
        """Queue a request. With a ``conversation_id`` the prompt is the *new* turn's input: the
        context is the conversation's history followed by it."""
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: empty prompt")
        hi = self.vocab_size
        bad = [t for t in prompt_token_ids
               if not (isinstance(t, int) and 0 <= t and (hi is None or t < hi))]
        if bad:
            raise ValueError(
                f"request {request_id}: token ids out of range [0, {hi}): {bad[:5]}")
        context = list(prompt_token_ids)
        if conversation_id is not None:
            conv = self.cache.conversations.get(conversation_id)
            if conv is not None:
                context = conv.token_ids + context
        req = Request(request_id, context, params,
                      arrival_time=self.now() if arrival_time is None else arrival_time,
                      eos_token_ids=self.eos_token_ids, conversation_id=conversation_id)
        self.scheduler.add_request(req)

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id, self.now())

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

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
                               keep_alive_s: float | None = None) -> None:
        """Retention hints: a higher priority or a keep-alive window keeps its KV longer."""
        if priority is not None and not priority > 0:
            raise ValueError(f"priority must be > 0, got {priority}")
        if keep_alive_s is not None and keep_alive_s < 0:
            raise ValueError(f"keep_alive_s must be >= 0, got {keep_alive_s}")
        self.cache.set_hints(self.cache.conversation(conversation_id), priority, keep_alive_s)

    # ---------------------------------------------------------------- a step
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update; returns the requests that finished in this step."""
        self.last_sampled = {}
        t0 = time.perf_counter()
        sched = self.scheduler.schedule(self.now())
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
        t2 = time.perf_counter()
        result = self._execute(sched)
        t3 = time.perf_counter()
        self.last_sampled = result.sampled_token_ids
        finished = self.scheduler.update_from_output(sched, result, self.now())
        if self.step_observers:
            rec = StepRecord.of(sched, result, t1 - t0, t3 - t2, time.perf_counter() - t3)
            for observe in self.step_observers:
                observe(rec)
        if self.audit:
            self.cache.check_integrity()
        self.num_steps += 1
        return [
            RequestOutput(r.request_id, r.prompt_token_ids, r.output_token_ids,
                          r.finish_reason, arrival_time=r.arrival_time,
                          first_token_time=r.first_token_time, finish_time=r.finish_time,
                          conversation_id=r.conversation_id,
                          cache_stats=r.cache_stats.as_dict())
            for r in finished
        ]

    def _core_stats(self, swap_in_bytes: int, swap_out_bytes: int) -> dict[str, int]:
        """Totals since start: token sources, swaps, drops, suspensions, blocks in use."""
        out = self.cache.stats.as_dict()
        out["split_range_requests"] = self.split_range_requests
        out["swap_in_bytes"] = swap_in_bytes
        out["swap_out_bytes"] = swap_out_bytes
        out["gpu_blocks_total"] = self.cache.gpu.num_blocks
        out["gpu_blocks_free"] = self.cache.gpu.num_free_blocks
        cpu = self.cache.cpu
        out["cpu_blocks_total"] = cpu.num_blocks if cpu is not None else 0
        out["cpu_blocks_free"] = cpu.num_free_blocks if cpu is not None else 0
        return out
