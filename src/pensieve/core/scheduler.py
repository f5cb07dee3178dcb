"""Iteration-level FCFS scheduler with unified (prefill + decode) batches over a tiered cache.

Each step grants every request some tokens under one budget (``max_num_batched_tokens``):
running requests first (a decode is one token, an unfinished prefill continues), then waiting
requests in arrival order while the budget, the running cap and the GPU blocks allow. There is
no prefill/decode flag: a request has ``pending`` positions to compute and each step takes some.

A turn of a conversation is admitted by the :class:`TieredKVCache`, which brings the
conversation's chunks to the GPU and returns what must be computed::

    [dropped: recompute][on CPU: swap in][on GPU][new prompt: compute]

(With ``swap_chunk_s`` the cache recomputes the CPU chunks that would take longer to swap in,
within the budget the step has left: they join the step's computed positions.) The GPU blocks
of background swap-outs are reclaimed in :meth:`Scheduler.update_from_output`, as the runner
reports their copies done.

If a running request cannot get a block, the most recently arrived running request is
suspended: its KV goes to the CPU tier (or is dropped) and it returns to the front of the queue.

``SchedulerConfig.batching="separate"`` is the vLLM 0.2 baseline instead: a step holds prefill
work only (continuing prompts, then admitted turns, same order and limits) or decodes only
(:func:`is_decode`). Prefill comes first whenever some can run; decodes wait. A turn is then
admitted only with GPU blocks for its whole prefill, so a prefill step never suspends anyone;
admission is bounded by ``max_num_seqs`` and the blocks, so prefill steps run out and decodes
follow. Decode steps suspend the newest request when blocks run out, as unified steps do.
"""

from __future__ import annotations

import math
import time
from collections import deque

from pensieve.core.conversation import Conversation
from pensieve.core.outputs import (
    QueryRange,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenHistory,
)
from pensieve.core.request import Request, RequestStatus
from pensieve.core.scheduling_config import SchedulerConfig
from pensieve.core.tiered_cache import TieredKVCache

MIN_PROMPT_TOKENS = 32
"""The least token budget a step time target leaves a step, beyond one token per running
decode: a long prompt always makes progress."""


def is_decode(req: Request, num_pending: int) -> bool:
    """Whether computing ``num_pending`` tokens of ``req`` is a decode: the turn has sampled a
    token and only that newest token's KV is left. Anything else (a new turn's prompt, a chunk
    of it, recomputation of dropped history) is prefill work."""
    return num_pending == 1 and bool(req.output_token_ids)


_NONE_READING: dict[str, int] = {}
"""No disk tier: no conversation waits for reads (never written)."""

class ConversationBusyError(ValueError):
    """A turn was submitted for a conversation whose previous turn is still in flight."""


class Scheduler:
    """Decides, each step, which tokens of which requests to compute."""

    def __init__(self, config: SchedulerConfig, cache: TieredKVCache) -> None:
        self.config = config
        self.cache = cache
        self._attention_pairs = config.attention_pairs()
        """A step's prefill attention budget (``SchedulerConfig.prefill_attention_pairs``)."""
        self._pairs_left = self._attention_pairs
        self.token_budget = config.max_num_batched_tokens
        """This step's token budget: ``max_num_batched_tokens``, or less while steps run slower
        than ``step_time_target_s`` allows (:meth:`observe_step`)."""
        self._seconds_per_token = 0.0
        self._fixed_step_s = 0.0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._busy: set[str] = set()  # conversations with a turn waiting or running
        self._finished_ids: list[str] = []

    @property
    def busy_conversations(self) -> set[str]:
        """Conversations with a turn waiting or running."""
        return self._busy

    @property
    def num_suspended(self) -> int:
        return self.cache.stats.suspended_requests

    # ------------------------------------------------------------------ requests in and out
    @property
    def max_turn_tokens(self) -> int:
        """Most tokens (context and answer) one turn may hold: the GPU tier less its decode
        reserve, within ``max_model_len``."""
        usable = self.cache.gpu.num_blocks - self.cache.decode_reserve_blocks
        return min(usable * self.cache.chunk_size, self.config.max_model_len)

    def check_new_turn(
        self, conversation_id: str | None, num_tokens: int, max_tokens: int = 1
    ) -> None:
        """Raise ValueError if a turn of ``num_tokens`` context tokens cannot be accepted."""
        if conversation_id is not None and conversation_id in self._busy:
            raise ConversationBusyError(
                f"conversation {conversation_id!r} already has a turn in flight")
        if num_tokens >= self.config.max_model_len:
            raise ValueError(
                f"context of {num_tokens} tokens leaves no room to generate within "
                f"max_model_len={self.config.max_model_len}"
            )
        c = self.cache.chunk_size
        usable = self.cache.gpu.num_blocks - self.cache.decode_reserve_blocks
        longest = min(num_tokens + max_tokens, self.config.max_model_len)
        if longest > self.max_turn_tokens:
            raise ValueError(
                f"context of {num_tokens} tokens plus up to {max_tokens} generated needs more "
                f"KV blocks than the GPU tier has ({usable} usable blocks of {c} tokens)"
            )

    def add_request(self, request: Request) -> None:
        """Queue a turn. Its prompt must extend its conversation's history."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        cid = request.conversation_id
        self.check_new_turn(cid, request.num_prompt_tokens, request.sampling_params.max_tokens)
        if cid is not None:
            history = self.cache.conversation(cid).token_ids
            if request.prompt_token_ids[: len(history)] != history:
                raise ValueError(f"request {request.request_id} does not extend conversation {cid}")
            self._busy.add(cid)
            self.cache.set_queued(self.cache.conversation(cid), request.arrival_time)
        self.cache.hash_turn(request)
        self.requests[request.request_id] = request
        self._queue(request)

    def _queue(self, request: Request) -> None:
        """Into the waiting queue behind every turn of its priority or a lower one
        (``SamplingParams.priority``): a scan from the tail, so O(1) while all are equal."""
        p, waiting = request.sampling_params.priority, self.waiting
        at = len(waiting)
        while at and waiting[at - 1].sampling_params.priority > p:
            at -= 1
        waiting.insert(at, request)

    def _conversation_of(self, req: Request) -> Conversation:
        cid = req.conversation_id
        if cid is None:
            return self.cache.conversation(req.request_id, ephemeral=True)
        return self.cache.conversation(cid)

    def abort_request(self, request_id: str, now: float | None = None) -> None:
        req = self.requests.get(request_id)
        if req is None or req.status.finished:
            return
        now = time.monotonic() if now is None else now
        conv = self._conversation_of(req)
        self.cache.abort_turn(req, conv, now)
        if conv.conversation_id in self.cache.conversations:
            self.cache.set_queued(conv, None)
        self._finish(req, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, now: float | None = None) -> bool:
        """End a running turn now, as if it had sampled a stop token (``FINISHED_STOPPED``;
        e.g. a stop string matched on its text): the cache ends the turn, keeping its KV.
        Returns False, doing nothing, for a request that is not running."""
        req = self.requests.get(request_id)
        if req is None or req.status is not RequestStatus.RUNNING:
            return False
        req.finish_time = time.monotonic() if now is None else now
        self.cache.end_turn(req, self._conversation_of(req), req.finish_time)
        self._finish(req, RequestStatus.FINISHED_STOPPED)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step
    def schedule(self, now: float | None = None) -> SchedulerOutput:
        now = time.monotonic() if now is None else now
        cache = self.cache
        cache.begin_step()
        if self.config.batching == "separate":
            # Prefill work first; decodes only when there is none that can run. A decode pass
            # that suspended every running request leaves their recomputation to a prefill pass.
            scheduled = self._fill(now, prefill=True)
            if not scheduled:
                scheduled = self._fill(now, prefill=False)
            if not scheduled:
                scheduled = self._fill(now, prefill=True)
        else:
            scheduled = self._fill(now, prefill=None)
        cache.plan_background(now)
        out = SchedulerOutput(
            requests=scheduled,
            swaps=cache.take_swap_plan(),
            finished_request_ids=self._finished_ids,
            disk=cache.take_disk_plan(),
        )
        self._finished_ids = []
        return out

    def _fill(self, now: float, prefill: bool | None) -> list[ScheduledRequest]:
        """One step's requests under the token budget. ``prefill``: None takes every kind of
        work (unified batches); True only prefill work, False only decodes (separate batches)."""
        cache = self.cache
        self._pairs_left = self._attention_pairs
        scheduled: list[ScheduledRequest] = []
        budget = self._fill_running(now, prefill, scheduled)

        # 2. Waiting requests, FCFS, while the budget, the cap and the blocks allow (separate
        # batches: while the head's work is of this step's kind). A turn with chunks to swap
        # in, admitted into a step with other work, computes from the next step on (unified).
        # Turns whose disk reads still run are passed over (kept in place) while others run.
        ahead_left = self.config.swap_in_ahead_chunks if prefill is None else 0
        waiting, at, reading = self.waiting, 0, self._disk_reading
        while len(waiting) > at and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = waiting[at]
            conv = self._conversation_of(req)
            if reading and self.running and conv.conversation_id in reading:
                at += 1
                continue
            pending = cache.pending_for(req, conv)
            total = sum(hi - lo for lo, hi in pending)
            if prefill is not None and is_decode(req, total) is prefill:
                break
            if total > budget and not self.config.enable_chunked_prefill:
                break
            n = min(total, budget)
            if n > 1 and self.config.enable_chunked_prefill:
                if not (n := self._attention_cap(pending[0][0], n)):
                    break
            req.pending = pending
            # Separate batches admit a turn only with blocks for all of its prefill (as vLLM
            # 0.2 does): its later chunks never suspend anyone, so a prefill step cannot undo
            # the last one's admission and prefill steps always run out.
            end = req.pending_end(n if prefill is None else total)
            since = cache.num_planned_swap_ins
            if not cache.admit(req, conv, end, now, spare_tokens=budget - n,
                               may_defer=bool(self.running)):
                req.pending = []
                break
            n = self._admitted_share(req, conv, n, total, now)
            del waiting[at]
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if scheduled and 0 < cache.num_planned_swap_ins - since <= ahead_left:
                ahead_left -= cache.swap_in_ahead(since)
                continue  # no budget taken: the next step's running pass computes it
            if n == 0:
                continue  # no block for its first pending token: the running pass grows it
            scheduled.append(self._take(req, conv, n))
            budget -= n
        return scheduled

    def _admitted_share(self, req: Request, conv: Conversation, n: int, total: int,
                        now: float) -> int:
        """The tokens an admitted turn computes in this step, given ``n`` of the ``total``
        pending before admission. Admission changes what is pending: CPU chunks chosen for
        recomputation join it (``n`` grows by them: the step's spare budget paid for them),
        chunks read back from disk leave it (the turn computes at most what is left). The
        share ends within the conversation's GPU blocks (grown if it must be and can be);
        0: none this step (the next step's running pass grows the conversation, or suspends
        it)::

            before  [dropped: recompute ........................][new]    n of them
            after   [from disk: swapped in ..........][recompute][new]    min(n, left)
        """
        left = req.num_pending
        n = n + left - total if left >= total else min(n, left)
        if n <= 0:
            return 0
        limit = len(conv.chunks) * self.cache.chunk_size
        end = req.pending_end(n)
        if end <= limit or self.cache.grow(conv, end, now):
            return n
        fits = 0  # no more blocks now: the pending tokens below the limit, in order
        for lo, hi in req.pending:
            if lo >= limit:
                break
            fits += min(hi, limit) - lo
        return min(n, fits)

    def _fill_running(self, now: float, prefill: bool | None,
                      scheduled: list[ScheduledRequest]) -> int:
        """1. Running requests, oldest first, onto ``scheduled``; the newest are suspended when
        blocks run out. Returns the token budget left."""
        cache, budget = self.cache, self.token_budget
        if budget < len(self.running) + MIN_PROMPT_TOKENS:  # every decode, and some progress
            budget = min(self.config.max_num_batched_tokens, len(self.running) + MIN_PROMPT_TOKENS)
        chunk_size, conversations, i = cache.chunk_size, cache.conversations, 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            pending = req.pending
            if len(pending) == 1:  # the usual case (a decode, a prompt's rest): no sums
                lo, hi = pending[0]
                num_pending = hi - lo
            else:
                num_pending = req.num_pending
            if prefill is not None and is_decode(req, num_pending) is prefill:
                i += 1
                continue
            n = min(num_pending, budget)
            if n > 1 and not (n := self._attention_cap(pending[0][0], n)):
                i += 1
                continue
            end = lo + n if len(pending) == 1 else req.pending_end(n)
            cid = req.conversation_id  # a running turn's conversation exists
            conv = conversations[cid if cid is not None else req.request_id]
            if end > len(conv.chunks) * chunk_size:  # it needs blocks
                suspended = False
                while not cache.grow(conv, end, now):
                    victim = self.running[-1]
                    self._suspend(victim, now)
                    if victim is req:
                        suspended = True
                        break
                if suspended:
                    break  # req itself was suspended; everything after it is too
            if len(pending) == 1 and n == num_pending:  # all of it (a decode): the hot path
                del pending[0]
                params = req.sampling_params
                scheduled.append(ScheduledRequest(
                    req.request_id, conv.block_table, [QueryRange(lo, req.token_ids_range(lo, hi))],
                    True, params, len(req.output_token_ids),
                    self._history(req) if params.needs_token_history else None))
            else:
                scheduled.append(self._take(req, conv, n))
            budget -= n
            i += 1
        return budget

    @property
    def _disk_reading(self) -> dict[str, int]:
        """Conversations whose queued turn waits for disk reads still running."""
        disk = self.cache.disk
        return disk.reading if disk is not None else _NONE_READING

    def observe_step(self, seconds: float, prefill_tokens: int, decode_tokens: int) -> None:
        """A step of ``prefill_tokens`` prompt tokens and ``decode_tokens`` decodes took
        ``seconds``. With a ``step_time_target_s``, a step's time is taken as a fixed part (a
        step of decodes only, measured) plus a time per prompt token (measured on the steps
        with prompt work, less the fixed part), each averaged over the last steps; the next
        steps' token budget is what the target leaves for prompt tokens beside the running
        decodes, within ``max_num_batched_tokens`` (and at least ``MIN_PROMPT_TOKENS``: where
        the fixed part alone takes the target, a smaller piece would only slow the prompt)."""
        target = self.config.step_time_target_s
        if not target or seconds <= 0:
            return
        if not prefill_tokens:
            fixed = self._fixed_step_s
            self._fixed_step_s = seconds if not fixed else 0.5 * (fixed + seconds)
            return
        per_token = max(seconds - self._fixed_step_s, 0.0) / prefill_tokens
        if self._seconds_per_token:
            per_token = 0.5 * (per_token + self._seconds_per_token)
        self._seconds_per_token = per_token
        room = target - self._fixed_step_s
        cap = self.config.max_num_batched_tokens
        if per_token <= 0 or room <= 0:
            self.token_budget = cap
            return
        self.token_budget = min(cap, max(MIN_PROMPT_TOKENS, decode_tokens + int(room / per_token)))

    def _attention_cap(self, start: int, n: int) -> int:
        """The most of ``n`` prompt tokens from position ``start`` that the step's attention
        pairs left allow (``SchedulerConfig.prefill_attention_pairs``), taken from them; 0
        when none are left."""
        left = self._pairs_left
        if n * (start + n / 2) > left:
            n = int(math.sqrt(start * start + 2 * left) - start)
            if n < 1 and left == self._attention_pairs:
                n = 1  # the step's first piece always makes progress
        if n > 0:
            self._pairs_left = left - int(n * (start + n / 2))
        return max(0, n)

    def _take(self, req: Request, conv: Conversation, n: int) -> ScheduledRequest:
        """The first ``n`` pending tokens of ``req`` as this step's share (a running decode's
        whole token is taken in :meth:`_fill_running` itself, the hot path)."""
        ranges = req.take(n)
        params = req.sampling_params
        sample = not req.pending
        return ScheduledRequest(req.request_id, conv.block_table, ranges, sample, params,
                                len(req.output_token_ids),
                                self._history(req) if sample and params.needs_token_history
                                else None)

    @staticmethod
    def _history(req: Request) -> TokenHistory:
        """The tokens the request's logits processors read (its step samples)."""
        return TokenHistory(req.prompt_token_ids, req.output_token_ids,
                            () if req.sampling_params.ignore_eos else req.eos_token_ids)

    def _suspend(self, req: Request, now: float) -> None:
        self.running.remove(req)
        conv = self._conversation_of(req)
        self.cache.suspend(req, conv, now)
        self.cache.set_queued(conv, req.arrival_time)
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------ results
    def update_from_output(
        self, sched: SchedulerOutput, result: RunnerOutput, now: float | None = None
    ) -> list[Request]:
        """Advance requests by what the step computed; returns requests that finished. The GPU
        blocks of background swap-outs the runner no longer reports in flight are reclaimed."""
        now = time.monotonic() if now is None else now
        finished: list[Request] = []
        requests, sampled, running = self.requests, result.sampled_token_ids, RequestStatus.RUNNING
        max_model_len = self.config.max_model_len
        for s in sched.requests:
            if not s.sample:
                continue
            rid = s.request_id
            req = requests.get(rid)
            if req is None or req.status is not running:
                continue
            token = sampled[rid]
            req.append_output(token)
            if req.first_token_time is None:
                req.first_token_time = now
            # why the turn stops, if it does (an end-of-sequence or stop token first)
            p, n_out = req.sampling_params, len(req.output_token_ids)
            if ((not p.ignore_eos and token in req.eos_token_ids)
                    or (p.stop_token_ids and token in p.stop_token_ids)):
                status = RequestStatus.FINISHED_STOPPED
            elif n_out >= p.max_tokens or len(req.prompt_token_ids) + n_out >= max_model_len:
                status = RequestStatus.FINISHED_LENGTH
            else:
                continue
            req.finish_time = now
            self.cache.end_turn(req, self._conversation_of(req), now)
            self._finish(req, status)
            finished.append(req)
        self.cache.reclaim_swap_outs(result.swap_outs_in_flight)
        return finished

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.conversation_id is not None:
            self._busy.discard(req.conversation_id)
        self._finished_ids.append(req.request_id)
        del self.requests[req.request_id]
