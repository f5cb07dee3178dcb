"""Iteration-level FCFS scheduler with unified (prefill + decode) batches.

Each step grants every request some tokens under one budget (``max_num_batched_tokens``):
running requests first (a decode is one token, an unfinished chunked prefill continues), then
waiting requests in arrival order while the budget, the running cap and the KV blocks allow.
There is no prefill/decode phase flag: a request simply has ``num_computed_tokens`` of its
``num_tokens`` with KV in the cache and is scheduled for the rest.

If a running request cannot get a block, the most recently arrived running request is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed
from its tokens (prompt and output so far) when it is admitted again.
"""

from __future__ import annotations

import time
from collections import deque

from pensieve.core.config import SchedulerConfig
from pensieve.core.kv_manager import KVCacheManager
from pensieve.core.outputs import QueryRange, RunnerOutput, ScheduledRequest, SchedulerOutput
from pensieve.core.request import Request, RequestStatus


class Scheduler:
    """Decides, each step, which tokens of which requests to compute."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        limit = self.config.max_model_len
        if request.num_prompt_tokens >= limit:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens leaves no room to generate "
                f"within max_model_len={limit}"
            )
        total_blocks = self.kv.pool.num_blocks
        if self.kv.num_new_blocks("", request.num_prompt_tokens + 1) > total_blocks:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens needs more KV blocks than the "
                f"cache has ({total_blocks} of {self.kv.chunk_size} tokens)"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.status.finished:
            self._finish(req, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []

        # 1. Running requests, oldest first; preempt the newest when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req.request_id, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            else:
                scheduled.append((req, n))
                budget -= n
                i += 1
                continue
            break  # req itself was preempted; everything after it is too

        # 2. Waiting requests, FCFS, while the budget, the cap and the blocks allow.
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            n = req.num_tokens - req.num_computed_tokens
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = min(n, budget)
            end = req.num_computed_tokens + n
            if not self.kv.can_admit(req.request_id, end) or not self.kv.allocate(
                req.request_id, end
            ):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n

        out = SchedulerOutput(
            requests=[self._scheduled(req, n) for req, n in scheduled],
            finished_request_ids=self._finished_ids,
        )
        self._finished_ids = []
        return out

    def _scheduled(self, req: Request, n: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        return ScheduledRequest(
            request_id=req.request_id,
            block_table=list(self.kv.block_table(req.request_id)),
            ranges=[QueryRange(start, req.token_ids_range(start, start + n))],
            sample=start + n == req.num_tokens,
            sampling_params=req.sampling_params,
            num_output_tokens=len(req.output_token_ids),
        )

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    # ------------------------------------------------------------------ results
    def update_from_output(
        self, sched: SchedulerOutput, result: RunnerOutput, now: float | None = None
    ) -> list[Request]:
        """Advance requests by what the step computed; returns requests that finished."""
        now = time.monotonic() if now is None else now
        finished: list[Request] = []
        for s in sched.requests:
            req = self.requests.get(s.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens += s.num_scheduled_tokens
            if not s.sample:
                continue
            token = result.sampled_token_ids[s.request_id]
            req.output_token_ids.append(token)
            if req.first_token_time is None:
                req.first_token_time = now
            status = self._stop_status(req, token)
            if status is not None:
                req.finish_time = now
                self._finish(req, status)
                finished.append(req)
        return finished

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        p = req.sampling_params
        if not p.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in p.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if len(req.output_token_ids) >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.request_id)
        self._finished_ids.append(req.request_id)
        del self.requests[req.request_id]
