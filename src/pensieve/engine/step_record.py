"""What one engine step did and what it cost, for observers (metrics, benchmarks, profilers).

:class:`EngineCore.step <pensieve.engine.engine_core.EngineCore.step>` builds one
:class:`StepRecord` per executed step and hands it to every function in
``EngineCore.step_observers``; nothing else reaches into the engine to time it.
:class:`StepTotals` is the usual observer: running sums a server exports on ``/metrics`` and a
benchmark differences over its window, so "per computed prefill token" costs and host time per
step come from the serving process itself.
No torch here.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, fields
from typing import IO, Any

from pensieve.core.outputs import RunnerOutput, SchedulerOutput


def prefill_decode_tokens(sched: SchedulerOutput) -> tuple[int, int]:
    """(prefill, decode) tokens of a step: a request with one scheduled token and some output
    is a decode, everything else (prompts, chunks of them, recomputed history) is prefill."""
    prefill = decode = 0
    for s in sched.requests:
        n = s.num_scheduled_tokens
        if n == 1 and s.num_output_tokens > 0:
            decode += 1
        else:
            prefill += n
    return prefill, decode


@dataclass(frozen=True)
class StepRecord:
    """One step: its work, its tier traffic and its times (seconds, host wall clock)."""

    num_requests: int
    prefill_tokens: int
    """Tokens computed for prompts and recomputed history (every range that is not a decode)."""
    decode_tokens: int
    swap_in_chunks: int
    swap_out_chunks: int
    """Ahead-of-time (background) swap-outs planned in this step."""
    urgent_swap_out_chunks: int
    """Swap-outs whose GPU blocks this very step reuses (the step waits for them)."""
    swap_outs_in_flight: int
    schedule_s: float
    """``Scheduler.schedule()``: admission, eviction, swap planning (host)."""
    execute_s: float
    """The executor's step: inputs, swaps, forward, sampling, up to the sampled ids."""
    update_s: float
    """``Scheduler.update_from_output()``: appending tokens, stop rules, ending turns (host)."""
    step_time_s: float
    """The executor's own step time (``RunnerOutput.step_time_s``: virtual in the simulator)."""
    failed_requests: int = 0
    """Requests whose execution raised in this step (aborted; the others ran)."""
    host_prepare_s: float = 0.0
    """The runner's host time before the forward was launched
    (``RunnerOutput.host_prepare_s``; 0 from an executor that does not measure it)."""
    host_issue_s: float = 0.0
    """The runner's host time until the whole forward was issued (``RunnerOutput.host_issue_s``)."""
    decode_split_span: bool = False
    """The decode attention split KV by span (``RunnerOutput.decode_split_span``)."""
    graph_replay: bool = False
    """The step replayed a CUDA graph (``RunnerOutput.graph_replay``)."""
    disk_wait_s: float = 0.0
    """Of ``schedule_s``: waiting for the disk tier's reads before scheduling
    (``DiskTier.collect``; 0 without a disk tier)."""
    disk_apply_s: float = 0.0
    """Of ``schedule_s``: carrying out the step's disk plan after scheduling (``DiskTier.apply``:
    the spilled blocks' bytes copied out, restores into CPU blocks, writes queued)."""
    disk_sync_s: float = 0.0
    """Of ``disk_apply_s``: waiting for the copies in flight into the CPU tier."""
    disk_out_s: float = 0.0
    """Of ``disk_apply_s``: copying the spilled chunks' bytes into write buffers."""
    disk_in_s: float = 0.0
    """Of ``disk_apply_s``: copying restored chunks' payloads into their CPU blocks."""
    sched: SchedulerOutput | None = field(default=None, repr=False, compare=False)
    """The step's plan (for observers that derive more from it; not in :meth:`as_dict`)."""
    output: RunnerOutput | None = field(default=None, repr=False, compare=False)
    """The executor's merged output (not in :meth:`as_dict`)."""

    @property
    def has_prefill(self) -> bool:
        return self.prefill_tokens > 0

    @staticmethod
    def of(sched: SchedulerOutput, out: RunnerOutput, schedule_s: float, execute_s: float,
           update_s: float, failed_requests: int = 0, disk_wait_s: float = 0.0,
           disk_apply_s: float = 0.0,
           disk_parts: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> StepRecord:
        prefill, decode = prefill_decode_tokens(sched)
        sw = sched.swaps
        return StepRecord(len(sched.requests), prefill, decode, sw.num_swap_in_chunks,
                          len(sw.swap_out), len(sw.swap_out_first), out.swap_outs_in_flight,
                          schedule_s, execute_s, update_s, out.step_time_s, failed_requests,
                          out.host_prepare_s, out.host_issue_s, out.decode_split_span,
                          out.graph_replay, disk_wait_s, disk_apply_s, *disk_parts, sched,
                          out)

    def as_dict(self) -> dict[str, Any]:
        """The counts and times (not the plan and output objects)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("sched", "output")}


@dataclass
class StepTotals:
    """Running sums over steps, split by whether a step computed prefill tokens."""

    steps: int = 0
    prefill_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    swap_in_chunks: int = 0
    swap_out_chunks: int = 0
    urgent_swap_out_chunks: int = 0
    schedule_s: float = 0.0
    update_s: float = 0.0
    execute_s: float = 0.0
    prefill_step_execute_s: float = 0.0
    """Executor time of the steps that computed prefill tokens (decodes in them included)."""
    decode_step_execute_s: float = 0.0
    prefill_step_prepare_s: float = 0.0
    """The runner's host time before the forward of those steps (``StepRecord.host_prepare_s``)."""
    decode_step_prepare_s: float = 0.0
    prefill_step_issue_s: float = 0.0
    """The runner's host time until those steps' forward was issued (``host_issue_s``)."""
    decode_step_issue_s: float = 0.0
    split_span_steps: int = 0
    """Steps whose decode attention split KV by span (ragged contexts)."""
    graph_steps: int = 0
    """Steps replayed from CUDA graphs."""
    prefill_graph_steps: int = 0
    """Of those, the steps that computed prefill tokens (mixed-step graphs)."""
    disk_sync_s: float = 0.0
    """The steps' disk plans (``StepRecord.disk_sync_s``, ``disk_out_s``, ``disk_in_s``)."""
    disk_out_s: float = 0.0
    disk_in_s: float = 0.0

    def __call__(self, r: StepRecord) -> None:
        self.steps += 1
        self.prefill_tokens += r.prefill_tokens
        self.decode_tokens += r.decode_tokens
        self.swap_in_chunks += r.swap_in_chunks
        self.swap_out_chunks += r.swap_out_chunks
        self.urgent_swap_out_chunks += r.urgent_swap_out_chunks
        self.schedule_s += r.schedule_s
        self.update_s += r.update_s
        self.execute_s += r.execute_s
        self.disk_sync_s += r.disk_sync_s
        self.disk_out_s += r.disk_out_s
        self.disk_in_s += r.disk_in_s
        self.split_span_steps += r.decode_split_span
        self.graph_steps += r.graph_replay
        if r.has_prefill:
            self.prefill_steps += 1
            self.prefill_graph_steps += r.graph_replay
            self.prefill_step_execute_s += r.execute_s
            self.prefill_step_prepare_s += r.host_prepare_s
            self.prefill_step_issue_s += r.host_issue_s
        else:
            self.decode_step_execute_s += r.execute_s
            self.decode_step_prepare_s += r.host_prepare_s
            self.decode_step_issue_s += r.host_issue_s

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def step_log_row(r: StepRecord, t: float) -> dict[str, Any]:
    """One step as a JSON-ready row: :meth:`StepRecord.as_dict`, ``t`` (seconds since the log
    opened) and, from the plan, the swap-ins the step waits for (``swap_in_step``) apart from
    those copied ahead for the next (``swap_in_ahead``), the prefill ranges and the KV they
    attend over (``prefill_ranges``, ``prefill_kv``: positions summed over the ranges' ends)."""
    row = r.as_dict()
    row["t"] = round(t, 4)
    if r.sched is not None:
        sw = r.sched.swaps
        row["swap_in_step"] = len(sw.swap_in)
        row["swap_in_ahead"] = len(sw.swap_in_ahead)
        ends = [q.start_pos + q.query_len for s in r.sched.requests for q in s.ranges
                if q.query_len > 1 or s.num_output_tokens == 0]
        row["prefill_ranges"] = len(ends)
        row["prefill_kv"] = sum(ends)
    return row


class StepLog:
    """A step observer that appends every step to a JSON-lines file (``pensieve serve`` with
    ``PENSIEVE_STEP_LOG=path``): what ``benchmarks/step_totals.py`` and the simulator's fits
    read, from a server as users run it. Line-buffered: a server stopped at any point leaves
    whole lines. ``{pid}`` in ``path`` becomes the process id: one file per engine process
    where several serve (replicas), whose steps would otherwise interleave in one file."""

    def __init__(self, path: str) -> None:
        path = path.replace("{pid}", str(os.getpid()))
        self._file: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        self._t0 = time.monotonic()

    def __call__(self, r: StepRecord) -> None:
        self._file.write(json.dumps(step_log_row(r, time.monotonic() - self._t0)) + "\n")

    def close(self) -> None:
        self._file.close()
