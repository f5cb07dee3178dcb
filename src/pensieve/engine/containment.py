"""Failure containment: when an executor raises on a step, only the requests that make it
raise fail; the others' step completes. No torch here.

:func:`execute_contained` runs the step; on an exception it re-runs the step's requests in
halves, recursively (bisection), each group without the step's copies (the executor issued
them before it raised: :mod:`pensieve.engine.executor`), until every group either ran or is a
single request that raises on its own: that request is a culprit. One culprit among ``n``
requests costs about ``2 log2 n`` extra executor calls. A failure that no single request
reproduces (a transient error) fails nobody. If no group ran, an empty step (every copy
waited for, none reported in flight) gives the step its output; if that raises too, the
executor itself is broken and the step's first exception propagates (the step fails as a
whole).

What the engine does with the culprits (:meth:`EngineCore.step`): it puts the positions the
step took back into their ``pending`` (their KV was not, or not surely, computed) and aborts
them, so their conversations are left as they were before the turn.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from pensieve.core.outputs import (
    QueryRange,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)

log = logging.getLogger("pensieve")

Execute = Callable[[SchedulerOutput], RunnerOutput]


@dataclass
class ContainedStep:
    """The step's merged output and the requests that failed in it."""

    output: RunnerOutput
    failed: dict[str, str] = field(default_factory=dict)
    """Request id -> the error its group raised (``"TypeName: message"``)."""
    executor_calls: int = 1


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def execute_contained(execute: Execute, sched: SchedulerOutput) -> ContainedStep:
    """Run ``sched``; on an exception isolate the failing requests (module docstring)."""
    try:
        return ContainedStep(execute(sched))
    except Exception as exc:  # noqa: BLE001 - contained below, or re-raised
        if not sched.requests:
            raise
        first = exc
    log.warning("step of %d requests failed (%s); re-running them in groups to isolate the "
                "cause", len(sched.requests), _describe(first), exc_info=first)
    step = ContainedStep(RunnerOutput({}))
    outputs: list[RunnerOutput] = []
    _isolate(execute, sched.requests, _describe(first), step, outputs)
    if not outputs:
        step.executor_calls += 1
        try:
            outputs.append(execute(SchedulerOutput(requests=[])))
        except Exception:
            raise first from None  # the executor is broken: its first error says why
    sampled: dict[str, int] = {}
    logprobs: dict[str, TokenLogprobs] = {}
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprobs]]] = {}
    for out in outputs:
        sampled.update(out.sampled_token_ids)
        logprobs.update(out.logprobs)
        prompt_logprobs.update(out.prompt_logprobs)
    step.output = RunnerOutput(sampled_token_ids=sampled,
                               step_time_s=sum(o.step_time_s for o in outputs),
                               host_prepare_s=sum(o.host_prepare_s for o in outputs),
                               host_issue_s=sum(o.host_issue_s for o in outputs),
                               swap_outs_in_flight=outputs[-1].swap_outs_in_flight,
                               decode_split_span=any(o.decode_split_span for o in outputs),
                               graph_replay=all(o.graph_replay for o in outputs),
                               logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    for rid, why in step.failed.items():
        log.error("request %s failed in a step and is aborted: %s", rid, why)
    return step


def _isolate(execute: Execute, group: list[ScheduledRequest], error: str, step: ContainedStep,
             outputs: list[RunnerOutput]) -> None:
    """``group`` raised ``error``: run its halves; a single request that raised is a culprit."""
    if len(group) == 1:
        step.failed[group[0].request_id] = error
        return
    mid = len(group) // 2
    for half in (group[:mid], group[mid:]):
        step.executor_calls += 1
        try:
            outputs.append(execute(SchedulerOutput(requests=half)))
        except Exception as exc:  # noqa: BLE001 - narrowed down further
            _isolate(execute, half, _describe(exc), step, outputs)


def restore_pending(pending: list[tuple[int, int]], taken: list[QueryRange],
                    unsure: list[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
    """``pending`` with the positions of ``taken`` (the step's ranges, which came off its
    front) put back, and those of ``unsure`` (chunks a copy of the failed step was to fill),
    overlapping or adjacent intervals merged::

        taken [0, 64) [200, 232)  +  pending [232, 260)  ->  [0, 64) [200, 260)
        unsure [96, 128)  +  pending [232, 260)          ->  [96, 128) [232, 260)
    """
    out: list[tuple[int, int]] = []
    for lo, hi in sorted([(r.start_pos, r.end_pos) for r in taken] + pending + (unsure or [])):
        if out and out[-1][1] >= lo:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def copied_chunks(block_table: tuple[int, ...], copied: set[int], chunk_size: int,
                  before: int) -> list[tuple[int, int]]:
    """The positions of the chunks (below position ``before``) whose GPU blocks a copy of the
    step was to fill (``copied``: the swap-ins' destination blocks): a request that failed in
    the step does not know them to hold its KV."""
    c = chunk_size
    return [(i * c, min((i + 1) * c, before)) for i, b in enumerate(block_table)
            if b in copied and i * c < before]
