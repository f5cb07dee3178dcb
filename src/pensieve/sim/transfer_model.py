"""Copies between the KV tiers in the simulator: the rates and latency of the swap copies
(:class:`TransferModel`, from ``benchmarks/swap_bandwidth.py``'s JSON or a default rate) and
the copy stream's timeline across steps (:class:`TransferTimeline`: background swap-outs that
outlive their step, ordered after the copies they touch as the runner orders them), which give
each simulated step its exposed copy time (:mod:`pensieve.sim.step_cost`). Pure Python, no
torch.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from pensieve.core.copy_order import copy_waits
from pensieve.core.jsonio import read_json_object, write_json_atomic
from pensieve.core.outputs import SwapPlan

TRANSFER_FORMAT = "pensieve-transfer"
DEFAULT_SWAP_GBPS = 45.0
"""One-way rate of the swap kernel on the H200 (GB/s), each direction, any block pattern; the
same figure as :data:`pensieve.config.DEFAULT_SWAP_BANDWIDTH_GBPS`."""
PREFERRED_CASES = ("kernel", "contig", "direct")
"""Rows of a ``benchmarks/swap_bandwidth.py`` result used when no case is named. Results with
a ``method`` per row (the swap kernel's benchmark): the ``kernel`` method's rows of the
``random`` block pattern (any ids, what serving produces). Older results with a ``case`` per
row (before the kernel): the first of these present: ``kernel``, ``contig`` (consecutive CPU
ids, what the CPU-tier allocator mostly handed out), ``direct``."""


@dataclass(frozen=True)
class TransferModel:
    """How long a step's copies between the tiers take, as measured on the interconnect, and
    how much of them the step waits for. It mirrors the runner's swap kernel path
    (:mod:`pensieve.runner.swapper`):

    * an *in* stream runs the step's urgent swap-outs (``SwapPlan.swap_out_first``), then its
      swap-ins layer by layer; the compute waits for the urgent copies (exposed in full), and
      layer i's attention for layer i's swap-ins only, so swap-ins are exposed only beyond the
      compute, plus ``latency_s`` and the first layer's share;
    * an *out* stream runs the background swap-outs (``SwapPlan.swap_out``) concurrently (PCIe
      is full duplex), one batch per step in plan order, not waited for by the step: a batch
      still in flight at the step's end counts in ``RunnerOutput.swap_outs_in_flight``, and
      its GPU blocks are reclaimed only once it is done;
    * a swap-in or urgent copy touching a CPU block that a batch in flight writes (or a GPU
      block it reads) waits for that batch; a background batch touching blocks of the step's
      in-stream copies waits for them (``step_waits`` of the runner);
    * urgent swap-outs take the host-bound direction first: background batches in flight are
      pushed back by the urgent copy's duration;
    * ``SwapPlan.swap_in_ahead`` copies follow the step's swap-ins on the in stream; the step
      does not wait for them, the next step's compute and in-stream copies start after them.

    Times: ``nbytes / (gbps * 1e9)`` per copy, plus ``latency_s`` once per launch (urgent
    copy, the first layer of the swap-ins, a background batch). The state across steps (the
    out stream's queue) lives in :class:`TransferTimeline`.
    """

    swap_in_gbps: float = DEFAULT_SWAP_GBPS
    """Host-to-device rate, GB/s (1e9 bytes per second)."""
    swap_out_gbps: float = DEFAULT_SWAP_GBPS
    """Device-to-host rate, GB/s."""
    latency_s: float = 0.0
    """Fixed time of one copy launch before data moves (the swap-ins' first layer waits for
    it); 0 by default. The copies before the kernel left time exposed beyond this model's
    transfer time, mostly host-side issue work the kernel removes (docs/performance.md,
    "Pipelined swap-in: exposed step time"); measure the kernel's."""
    num_layers: int | None = None
    """Swap-ins are pipelined per layer: with L layers layer 0's share ``T / L`` is always
    exposed and the last layer's compute ``C / L`` follows the last copy. None: the limit of
    many layers (exposed ``max(0, T - C)``)."""
    pipelined: bool = True
    """False: every step waits for all its swap-ins before computing (what a step replayed
    from a CUDA graph does in the runner, ``ModelRunner.execute``): exposed ``T`` in full."""
    graph_max_tokens: int = 0
    """Steps of at most this many tokens are taken to run from CUDA graphs and so wait for
    all their swap-ins (the engine on CUDA replays mixed steps up to 512 tokens when
    ``cuda_graph_mixed`` is on); larger steps run eagerly, pipelined. 0: none."""
    graph_max_swap_in: int | None = None
    """Of the steps :attr:`graph_max_tokens` covers, those with more of their own swap-in
    chunks than this (``SwapPlan.swap_in``; not the ones ahead) run eagerly, pipelined, as the
    runner does (``ModelRunner.graph_max_swap_in``). None: no limit (every such step waits for
    all its swap-ins). Their extra launch time: :attr:`eager_launch_s`."""
    eager_launch_s: float = 0.0
    """Extra time of a step that :attr:`graph_max_swap_in` makes run eagerly instead of from a
    CUDA graph (the eager launch of a step of a few hundred tokens; the simulator adds it to
    the step's compute). 0: not modelled."""
    urgent_pipelined: bool = False
    """What-if (the runner does not do this): a step's urgent swap-outs go layer by layer with
    its swap-ins on the in stream (layer i's urgent copies, then its swap-ins, then its
    attention) instead of all before the step's compute, so they are exposed only beyond the
    compute, like the swap-ins. A step that waits for all of its swap-ins (:attr:`pipelined`
    off, a CUDA-graph step) still waits for all of its urgent copies first."""
    ahead_layered: bool = False
    """The runner's ``ahead_waits="layers"`` (its default, chosen by an A/B:
    docs/performance_history.md, "Host time of steps with prefill, and what the server's step log
    shows"; off here unless asked, as in the fits and validations before it): a step waits
    for the previous step's ``swap_in_ahead`` copies layer by layer, as for its own pipelined
    swap-ins, instead of before its compute; a step that waits for all of its swap-ins (a
    CUDA-graph step here) still waits for all of them first."""
    issue_group_s: float = 0.0
    """Host time to issue one group of staged copies (a copy call, a scatter or gather launch,
    their events), before the step's forward is launched: the device idles meanwhile. 0: not
    modelled (the fitted step costs hold it on average)."""
    issue_chunk_s: float = 0.0
    """Host time to issue the copies of one chunk (descriptors, index uploads)."""
    in_groups: int = 8
    """Groups of layers a step's own swap-ins are issued by (the ``staged`` swapper's); its
    ahead copies go in one, or with :attr:`ahead_layered` in as many."""
    background_after_launch: bool = False
    """The runner's way (chosen by the same A/B as :attr:`ahead_layered`; off here unless
    asked): a step of at most
    :attr:`defer_max_tokens` tokens (a graph step) issues its ahead copies and background
    swap-outs once its forward is launched: their issue time is off the step's critical path,
    and they start that much later."""
    defer_max_tokens: int = 512
    """The largest step :attr:`background_after_launch` applies to: the runner's mixed-step
    graphs' (``MIXED_GRAPH_MAX_TOKENS``); larger steps run eagerly and issue every copy first."""
    source: str = ""
    """Where the rates come from (a file, "default")."""

    def __post_init__(self) -> None:
        for name in ("swap_in_gbps", "swap_out_gbps"):
            v = float(getattr(self, name))
            if not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a positive, finite rate in GB/s, got {v}")
            object.__setattr__(self, name, v)
        for name in ("latency_s", "issue_group_s", "issue_chunk_s"):
            v = float(getattr(self, name))
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {v}")
            object.__setattr__(self, name, v)
        if self.in_groups < 1:
            raise ValueError(f"in_groups must be >= 1, got {self.in_groups}")
        if self.num_layers is not None and (isinstance(self.num_layers, bool)
                                            or not isinstance(self.num_layers, int)
                                            or self.num_layers < 1):
            raise ValueError(f"num_layers must be None or an int >= 1, got {self.num_layers!r}")
        if isinstance(self.graph_max_tokens, bool) or not isinstance(self.graph_max_tokens, int) \
                or self.graph_max_tokens < 0:
            raise ValueError(f"graph_max_tokens must be an int >= 0, got "
                             f"{self.graph_max_tokens!r}")
        g = self.graph_max_swap_in
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 0):
            raise ValueError(f"graph_max_swap_in must be None or an int >= 0, got {g!r}")
        e = float(self.eager_launch_s)
        if not math.isfinite(e) or e < 0:
            raise ValueError(f"eager_launch_s must be finite and >= 0, got {e}")
        object.__setattr__(self, "eager_launch_s", e)

    def in_seconds(self, nbytes: float) -> float:
        """Transfer time of ``nbytes`` host-to-device (no latency)."""
        return nbytes / (self.swap_in_gbps * 1e9)

    def out_seconds(self, nbytes: float) -> float:
        """Transfer time of ``nbytes`` device-to-host (no latency)."""
        return nbytes / (self.swap_out_gbps * 1e9)

    def waits_for_all_swap_ins(self, num_tokens: int | None, num_swap_in: int = 0) -> bool:
        """Whether a step of ``num_tokens`` tokens (None: unknown) with ``num_swap_in`` chunks
        of its own to swap in computes only after all of its swap-ins (not :attr:`pipelined`,
        or a CUDA-graph step)."""
        if not self.pipelined:
            return True
        if self.graph_max_swap_in is not None and num_swap_in > self.graph_max_swap_in:
            return False
        return num_tokens is not None and 0 < num_tokens <= self.graph_max_tokens

    def eager_extra_s(self, num_tokens: int | None, num_swap_in: int) -> float:
        """:attr:`eager_launch_s` for a step of ``num_tokens`` tokens that the graphs would
        replay but its ``num_swap_in`` chunks of its own make run eagerly, else 0."""
        if (not self.eager_launch_s or not self.waits_for_all_swap_ins(num_tokens)
                or self.waits_for_all_swap_ins(num_tokens, num_swap_in)):
            return 0.0
        return self.eager_launch_s

    def swap_in_finish(self, copy_start: float, compute_start: float, transfer_s: float,
                       compute_s: float, pipelined: bool | None = None) -> float:
        """When a step ends whose compute (``compute_s``, from ``compute_start``) waits, layer
        by layer (or, not ``pipelined``, all at once), for swap-ins that take ``transfer_s``
        from ``copy_start``. ``pipelined`` defaults to :attr:`pipelined`."""
        if transfer_s <= 0.0:
            return compute_start + compute_s
        first = copy_start + self.latency_s
        if not (self.pipelined if pipelined is None else pipelined):
            return max(compute_start, first + transfer_s) + compute_s
        n = self.num_layers
        a = transfer_s / n if n else 0.0
        c = compute_s / n if n else 0.0
        # layer i computes after copy i ends (first + (i + 1) a): the latest of the two ends
        return max(compute_start + compute_s, first + a + compute_s, first + transfer_s + c)

    # ------------------------------------------------------------------ storage
    def to_dict(self) -> dict[str, Any]:
        return {"format": TRANSFER_FORMAT, "version": 1,
                **{f.name: getattr(self, f.name) for f in fields(self)}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TransferModel:
        if d.get("format", TRANSFER_FORMAT) != TRANSFER_FORMAT:
            raise ValueError(f"not a transfer model (format {d.get('format')!r})")
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known - {"format", "version"}
        if unknown:
            raise ValueError(f"unknown transfer model key(s) {sorted(unknown)}")
        return cls(**{k: v for k, v in d.items() if k in known})

    def save(self, path: str | os.PathLike[str]) -> None:
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str], case: str | None = None,
             pattern: str | None = None, **overrides: Any) -> TransferModel:
        """Rates from a JSON file: one written by :meth:`save`; an object with
        ``swap_in_gbps`` and ``swap_out_gbps`` (and optionally ``latency_s``); or the output
        of ``benchmarks/swap_bandwidth.py`` (``rows`` with ``dir``, ``bytes``, ``s``), where
        each direction's rate is the byte-weighted one (total bytes over total time) over the
        selected rows of that direction (``in``, ``out``; the ``in+out`` rows are not used).
        Rows are selected by ``case``: the ``method`` (default ``kernel``) and ``pattern``
        (default ``random``) in results that have them, else the older ``case`` (default: see
        :data:`PREFERRED_CASES`). ``overrides`` set other fields (``latency_s``,
        ``num_layers``, ``pipelined``, ``graph_max_tokens``)."""
        d = read_json_object(path)
        src = os.fspath(path)
        if d.get("format") == TRANSFER_FORMAT:
            return dataclasses.replace(cls.from_dict(d), **overrides)
        if "swap_in_gbps" in d and "swap_out_gbps" in d:
            kw: dict[str, Any] = {"swap_in_gbps": d["swap_in_gbps"],
                                  "swap_out_gbps": d["swap_out_gbps"], "source": src}
            if "latency_s" in d:
                kw["latency_s"] = d["latency_s"]
            return cls(**{**kw, **overrides})
        rows = d.get("rows")
        if not isinstance(rows, list) or not rows:
            raise ValueError(f"{src}: no swap_in_gbps/swap_out_gbps and no measured rows")
        if any("method" in r for r in rows):  # the swap kernel's benchmark
            case = case or "kernel"
            pattern = pattern or "random"
            sel_all = [r for r in rows if r.get("method") == case and r.get("chunks")
                       and r.get("pattern", pattern) == pattern]
            what = f"method {case!r}, pattern {pattern!r}"
            label = f"{case}, {pattern}"
        else:
            cases = [r.get("case") for r in rows if r.get("dir") in ("in", "out")]
            if case is None:
                case = next((c for c in PREFERRED_CASES if c in cases), None)
                if case is None:
                    raise ValueError(f"{src}: none of the cases {list(PREFERRED_CASES)}; name "
                                     f"one of {sorted(set(map(str, cases)))}")
            sel_all = [r for r in rows if r.get("case") == case]
            what = f"case {case!r}"
            label = case
        rates: dict[str, float] = {}
        for direction in ("in", "out"):
            sel = [r for r in sel_all if r.get("dir") == direction]
            nbytes = sum(float(r["bytes"]) for r in sel)
            secs = sum(float(r["s"]) for r in sel)
            if not sel or secs <= 0:
                raise ValueError(f"{src}: no '{direction}' rows of {what}")
            rates[direction] = nbytes / secs / 1e9
        return cls(**{"swap_in_gbps": rates["in"], "swap_out_gbps": rates["out"],
                      "source": f"{src} [{label}]", **overrides})


@dataclass(frozen=True)
class StepTransfer:
    """What the copies did to one step (:meth:`TransferTimeline.step`)."""

    step_s: float
    """The step's duration: compute plus exposed copy time."""
    exposed_copy_s: float
    """Time the step waited for copies beyond its compute."""
    swap_outs_in_flight: int
    """Background batches still copying when the step ends, this step's included."""
    swap_in_s: float = 0.0
    """Transfer time of the step's swap-ins (no latency)."""
    urgent_s: float = 0.0
    """Transfer time of its urgent swap-outs."""
    background_s: float = 0.0
    """Transfer time of its background swap-out batch."""
    background_done_at: float | None = None
    """When its background batch completes (None: it had none)."""


@dataclass
class _Batch:
    done_at: float
    cpu_writes: frozenset[int]
    gpu_reads: frozenset[int]


class TransferTimeline:
    """The copy streams of :class:`TransferModel` over a run: absolute times on the caller's
    clock, a FIFO of background batches in flight. One :meth:`step` per engine step, in order,
    with non-decreasing start times."""

    def __init__(self, model: TransferModel, block_bytes: int) -> None:
        if block_bytes < 0:
            raise ValueError(f"block_bytes must be >= 0, got {block_bytes}")
        self.model = model
        self.block_bytes = block_bytes
        self.in_flight: deque[_Batch] = deque()
        self.out_free_at = -math.inf
        """When the out stream has finished every batch queued so far."""
        self.ahead_done_at = -math.inf
        """When the in stream finishes the last step's ``swap_in_ahead`` copies: the next
        step's compute and in-stream copies start no earlier."""

    def step(self, start: float, plan: SwapPlan, compute_s: float,
             num_tokens: int | None = None) -> StepTransfer:
        """Advance by one step that starts at ``start``, copies ``plan`` and computes for
        ``compute_s`` seconds. Within the step times are relative to ``start`` (a step with
        no copy to wait for lasts exactly ``compute_s``). ``num_tokens``: the step's tokens,
        if known: small steps may be CUDA-graph steps (:attr:`TransferModel.graph_max_tokens`),
        and a step with none (no request) waits for every copy in flight, as the runner's
        does, and reports none in flight."""
        m, bb = self.model, self.block_bytes
        t_urgent = m.out_seconds(len(plan.swap_out_first) * bb)
        t_in = m.in_seconds(len(plan.swap_in) * bb)
        t_bg = m.out_seconds(len(plan.swap_out) * bb)
        # Batches that finished before the step began are gone (the runner pops them too).
        self._pop(start)
        after, out_after_in = copy_waits(plan, self.in_flight)
        # the in stream (urgent swap-outs, then swap-ins) waits for a conflicting batch
        in_start = max(0.0, self.in_flight[after].done_at - start) if after >= 0 else 0.0
        # the previous step's copies ahead: on the in stream, and waited for by the compute
        # (before it, or with ahead_layered layer by layer, pipelined with it)
        layered = not m.waits_for_all_swap_ins(num_tokens, len(plan.swap_in))
        ahead_rem = max(0.0, self.ahead_done_at - start)
        ahead_by_layer = m.ahead_layered and layered and num_tokens != 0
        compute_start = 0.0 if ahead_by_layer else ahead_rem
        in_start = max(in_start, ahead_rem)
        copy_start = in_start
        # the host's issue of the step's copies before its forward is launched
        host, after_launch = self._issue_s(plan, num_tokens)
        compute_start = max(compute_start, host)
        # urgent copies inside the layer pipeline (what-if): one stream of urgent + swap-in
        with_urgent = bool(plan.swap_out_first) and m.urgent_pipelined and layered
        if plan.swap_out_first:
            urgent = m.latency_s + t_urgent
            for b in self.in_flight:  # they take the host-bound direction first
                if b.done_at > start + in_start:
                    b.done_at += urgent
            if self.out_free_at > start + in_start:
                self.out_free_at += urgent
            if not with_urgent:
                copy_start = in_start + urgent
                compute_start = copy_start  # nothing touches KV before the urgent copies
            self.out_free_at = max(self.out_free_at, start + in_start + urgent)
        t_layers = t_in + (t_urgent if with_urgent else 0.0)
        end = m.swap_in_finish(copy_start, compute_start, t_layers, compute_s, layered)
        if ahead_by_layer and ahead_rem > 0.0:  # the ahead copies' tail, already under way
            end = max(end, m.swap_in_finish(-m.latency_s, compute_start, ahead_rem, compute_s,
                                            True))
        in_done = copy_start + (m.latency_s + t_layers if plan.swap_in or with_urgent else 0.0)
        if plan.swap_in_ahead:  # after the step's own in-stream copies, not waited for by it
            in_done = max(in_done, after_launch)
            in_done += m.latency_s + m.in_seconds(len(plan.swap_in_ahead) * bb)
            self.ahead_done_at = start + in_done
        done_at: float | None = None
        if plan.swap_out:
            b_start = max(start + after_launch, self.out_free_at)
            if out_after_in:
                b_start = max(b_start, start + in_done)
            done_at = b_start + m.latency_s + t_bg
            self.out_free_at = done_at
            self.in_flight.append(_Batch(done_at, frozenset(c for _, c in plan.swap_out),
                                         frozenset(g for g, _ in plan.swap_out)))
        if num_tokens == 0:  # a step without requests drains the copies
            if self.in_flight:
                end = max(end, self.in_flight[-1].done_at - start)
                self.in_flight.clear()
            end = max(end, self.ahead_done_at - start)
        self._pop(start + end)
        return StepTransfer(step_s=end, exposed_copy_s=max(0.0, end - compute_s),
                            swap_outs_in_flight=len(self.in_flight), swap_in_s=t_in,
                            urgent_s=t_urgent, background_s=t_bg, background_done_at=done_at)

    def _issue_s(self, plan: SwapPlan, num_tokens: int | None) -> tuple[float, float]:
        """(host time before the forward is launched, when the copies deferred past the
        launch are issued): the step's own swap-ins by :attr:`~TransferModel.in_groups`,
        urgent swap-outs, ahead copies and background swap-outs in one group each (the ahead
        copies by ``in_groups`` with ``ahead_layered``); the last two after the launch with
        ``background_after_launch`` on a step of at most ``defer_max_tokens`` tokens."""
        m = self.model
        if not (m.issue_group_s or m.issue_chunk_s):
            return 0.0, 0.0

        def issue(groups: int, chunks: int) -> float:
            return m.issue_group_s * groups + m.issue_chunk_s * chunks if chunks else 0.0

        own = (issue(m.in_groups, len(plan.swap_in))
               + issue(1, len(plan.swap_out_first)))
        ahead_groups = m.in_groups if m.ahead_layered else 1
        background = (issue(ahead_groups, len(plan.swap_in_ahead))
                      + issue(1, len(plan.swap_out)))
        deferred = (m.background_after_launch and num_tokens is not None
                    and 0 < num_tokens <= m.defer_max_tokens)
        if deferred:
            return own, own + background
        return own + background, 0.0

    def _pop(self, t: float) -> None:
        while self.in_flight and self.in_flight[0].done_at <= t:
            self.in_flight.popleft()

    @property
    def next_done_at(self) -> float | None:
        """When the oldest background batch in flight completes (None: nothing in flight)."""
        return self.in_flight[0].done_at if self.in_flight else None
