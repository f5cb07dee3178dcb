"""The one contract between deciding (scheduler) and doing (runner).

The scheduler emits one :class:`SchedulerOutput` per step; the runner executes it and returns
one :class:`RunnerOutput`. Nothing else crosses the boundary.

Positions and ranges. A request's context is addressed by position ``0..num_tokens-1``; its
block table maps position ``p`` to slot ``block_table[p // chunk_size] * chunk_size +
p % chunk_size``. A step computes one or more *query ranges* of a request: contiguous runs of
positions whose K/V are written to the cache and whose queries attend causally to every cached
position ``<= p``. A request normally has one range; the stateful cache recomputes dropped
leading tokens as a second range that shares the same block table::

    positions  0 ........ d-1 | d ......... n-1 | n ........ n+q-1
               [dropped: range 0][cached on gpu  ][new prompt: range 1]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from pensieve.core.disk_index import DiskPlan as DiskPlan
from pensieve.core.sampling_params import SamplingParams

# The per-request records (one or two per running request per step) are NamedTuples: immutable
# like the frozen dataclasses below, and about 3x cheaper to build (0.3 against 0.8-1.5 us on
# the development VM): with hundreds of running requests they were most of a step's host time.


class QueryRange(NamedTuple):
    """``len(token_ids)`` consecutive tokens starting at position ``start_pos``."""

    start_pos: int
    token_ids: list[int]

    @property
    def query_len(self) -> int:
        return len(self.token_ids)

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


class TokenHistory(NamedTuple):
    """The tokens a request's logits processors read (penalties, ``min_tokens``); a step
    carries it only for the requests whose sampling parameters need it."""

    prompt_token_ids: list[int]
    """The turn's whole context (the conversation's history and the new input)."""
    output_token_ids: list[int]
    """The tokens generated so far in this turn."""
    eos_token_ids: tuple[int, ...]
    """End-of-sequence ids that ``min_tokens`` masks (empty with ``ignore_eos``)."""


class ScheduledRequest(NamedTuple):
    """One request's share of a step."""

    request_id: str
    block_table: tuple[int, ...]
    """GPU block ids covering positions ``[0, context_len)`` of the request after this step.
    The cache's own (immutable) table of the conversation, replaced, never changed, as it
    grows: passed without a copy."""
    ranges: list[QueryRange]
    """Query ranges to compute, in position order; the last one ends at ``context_len``."""
    sample: bool
    """Sample a next token from the last query token of the last range."""
    sampling_params: SamplingParams
    num_output_tokens: int
    """Tokens generated so far: seeds per-token randomness when the request has a seed."""
    token_history: TokenHistory | None = None
    """Set when this step samples for a request whose processors read its tokens."""

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.query_len for r in self.ranges)

    @property
    def context_len(self) -> int:
        return self.ranges[-1].end_pos


@dataclass(frozen=True)
class SwapPlan:
    """Chunk copies between the GPU tier and the CPU tier for one step, as block-id pairs.

    The runner issues them on one copy stream in this order, so GPU-to-CPU copies that are not
    urgent wait behind the swap-ins (PCIe contention: swap-in first):

    1. ``swap_out_first`` (gpu_block, cpu_block): urgent evictions whose GPU blocks are reused
       in this very step; complete before the step's compute touches any KV.
    2. ``swap_in`` (cpu_block, gpu_block): layer by layer; layer i's attention waits for
       layer i's copies only (pipelined with compute).
    3. ``swap_in_ahead`` (cpu_block, gpu_block): swap-ins of turns admitted in this step
       that compute from the next step on (``SchedulerConfig.swap_in_ahead_chunks``):
       issued after ``swap_in`` on the same stream; this step's compute does not wait for
       them, the next step's compute does (before it touches any KV). Their CPU blocks are
       not reused before the step after next.
    4. ``swap_out`` (gpu_block, cpu_block): ahead-of-time evictions, issued in the
       background: they may still be in flight when the step ends and overlap later steps.
       Their GPU blocks are reclaimed by the cache only once the runner reports the copy done
       (:attr:`RunnerOutput.swap_outs_in_flight`); nothing writes those blocks until then.

    Urgent swap-outs and swap-ins are complete when the runner returns its RunnerOutput;
    ``swap_in_ahead`` copies when the next step's compute starts (or when a step without
    requests returns). Background swap-out batches complete in the order they were planned.
    """

    swap_out_first: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in_ahead: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.swap_out_first or self.swap_in or self.swap_out or self.swap_in_ahead)

    @property
    def num_swap_in_chunks(self) -> int:
        """Chunks copied in during the step: its own swap-ins and those ahead."""
        return len(self.swap_in) + len(self.swap_in_ahead)

    def check(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """ValueError unless every list has its block ids in range and distinct (a runner
        checks a plan before it issues any copy of it)."""
        _check_pairs(self.swap_out_first, "swap_out_first", True, num_gpu_blocks, num_cpu_blocks)
        _check_pairs(self.swap_in, "swap_in", False, num_gpu_blocks, num_cpu_blocks)
        _check_pairs(self.swap_in_ahead, "swap_in_ahead", False, num_gpu_blocks, num_cpu_blocks)
        _check_pairs(self.swap_out, "swap_out", True, num_gpu_blocks, num_cpu_blocks)


def _check_pairs(pairs: list[tuple[int, int]], what: str, gpu_first: bool,
                 num_gpu_blocks: int, num_cpu_blocks: int) -> None:
    if not pairs:
        return
    gpu = [p[0] if gpu_first else p[1] for p in pairs]
    cpu = [p[1] if gpu_first else p[0] for p in pairs]
    if min(gpu) < 0 or max(gpu) >= num_gpu_blocks:
        raise ValueError(f"{what}: GPU block out of range [0, {num_gpu_blocks})")
    if min(cpu) < 0 or max(cpu) >= num_cpu_blocks:
        raise ValueError(f"{what}: CPU block out of range [0, {num_cpu_blocks})")
    if len(set(gpu)) != len(gpu) or len(set(cpu)) != len(cpu):
        raise ValueError(f"{what}: repeated GPU or CPU block")


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything the runner needs for one step, in batch order."""

    requests: list[ScheduledRequest]
    swaps: SwapPlan = field(default_factory=SwapPlan)
    finished_request_ids: list[str] = field(default_factory=list)
    """Requests that ended since the last step (the runner may drop per-request state)."""
    disk: DiskPlan = field(default_factory=DiskPlan)
    """The disk tier's reads, writes and deletes (empty without a disk tier), carried out
    before the step's copies by whoever drives the disk (the engine's disk tier, or the
    simulator's)."""

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests and self.swaps.is_empty

    def decode_kv_lens(self) -> list[int]:
        """The KV length each one-token range (decode) attends over, in step order."""
        return [r.start_pos + 1 for s in self.requests for r in s.ranges if r.query_len == 1]

    def ranges_in_order(self, decodes_first: bool) -> tuple[list[tuple[int, int, QueryRange]], int]:
        """Every query range as ``(request index, range index, range)``, in step order or,
        ``decodes_first``, the one-token ranges first (stable), then the others; and how many
        one-token ranges lead (0 unless ``decodes_first``). The runner's token layout when a
        step's decodes attend in a launch of their own."""
        items = [(i, j, rng) for i, s in enumerate(self.requests) for j, rng in enumerate(s.ranges)]
        if not decodes_first:
            return items, 0
        dec = [x for x in items if x[2].query_len == 1]
        return dec + [x for x in items if x[2].query_len > 1], len(dec)


class TokenLogprobs(NamedTuple):
    """A sampled token's log-probability and the most likely tokens of its position."""

    logprob: float
    """The sampled token's log-probability (log-softmax of the unscaled logits)."""
    top: tuple[tuple[int, float], ...]
    """``SamplingParams.logprobs`` (token id, log-probability) pairs, most likely first."""


@dataclass(frozen=True)
class RunnerOutput:
    """What one step produced."""

    sampled_token_ids: dict[str, int]
    """Next token for every scheduled request with ``sample=True``."""
    step_time_s: float = 0.0
    """Wall time of the step as seen by the runner (synchronised on CUDA)."""
    host_prepare_s: float = 0.0
    """Host time from the step's start until its forward is launched: issuing the swaps,
    building the inputs (or filling a CUDA graph's buffers). The previous step ended with a
    synchronisation, so on a GPU the compute stream is idle meanwhile."""
    host_issue_s: float = 0.0
    """Host time from the step's start until its whole forward is issued, before waiting for
    the sampled tokens. On a GPU, ``step_time_s - host_issue_s`` is the wait for the device
    once the host is done; an issue time near the step time means a host-bound step. On the
    CPU the forward runs as it is issued, so this is most of the step."""
    decode_split_span: bool = False
    """Whether the step's decode attention split KV by span (a ragged decode step:
    ``kernels/launch_policy.py``); counted on ``/metrics`` to show how often it applies."""
    graph_replay: bool = False
    """Whether the step replayed a CUDA graph (decode or mixed-step) rather than running
    eagerly; counted on ``/metrics`` by step kind."""
    swap_outs_in_flight: int = 0
    """Background swap-out batches (one per step whose plan had ``swap_out``) whose copies
    are still running after this step, this step's included. They complete in plan order, so
    the cache reclaims the GPU blocks of every older batch. 0: every copy is done."""
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    """For each sampled request whose ``SamplingParams.logprobs`` is set: the sampled token's
    log-probability and the top alternatives, computed from the very logits it was sampled
    from. An executor that computes no logits (the simulator) leaves this empty."""
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprobs]]] = field(default_factory=dict)
    """For each request whose ``SamplingParams.prompt_logprobs`` is set: (position, the
    log-probability of the token there given those before it) for the prompt positions this
    step scored (:mod:`pensieve.runner.prompt_logprobs`)."""
