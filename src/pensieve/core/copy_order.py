"""The order of one step's tier copies against background batches still in flight (no torch).

The runner (:func:`pensieve.runner.swapper.step_waits`) and the simulator
(:func:`pensieve.sim.step_cost.copy_waits`) both decide with :func:`copy_waits`: a step's
urgent swap-outs and swap-ins, ahead ones included (the *in* stream), must wait for the newest
in-flight background batch that writes a CPU block they read or write, or reads a GPU block a
swap-in overwrites;
the step's own background swap-outs (the *out* stream) wait for its in-stream copies only
where they touch the same blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from pensieve.core.outputs import SwapPlan


class InFlightBatch(Protocol):
    """What the ordering needs of a background batch in flight."""

    @property
    def cpu_writes(self) -> Iterable[int] | set[int] | frozenset[int]: ...

    @property
    def gpu_reads(self) -> Iterable[int] | set[int] | frozenset[int]: ...


def copy_waits(plan: SwapPlan, in_flight: Sequence[InFlightBatch]) -> tuple[int, bool]:
    """``(in_after, out_after_in)``: the index in ``in_flight`` (oldest first) of the newest
    batch the in stream must wait for, or -1; whether the step's background swap-outs wait for
    its in-stream copies."""
    in_cpu = {c for c, _ in plan.swap_in}
    in_cpu.update(c for c, _ in plan.swap_in_ahead)
    in_cpu.update(c for _, c in plan.swap_out_first)
    in_gpu = {g for _, g in plan.swap_in}
    in_gpu.update(g for _, g in plan.swap_in_ahead)
    after = -1
    if in_cpu or in_gpu:
        for i, b in enumerate(in_flight):
            if not (in_cpu.isdisjoint(b.cpu_writes) and in_gpu.isdisjoint(b.gpu_reads)):
                after = i
    out_after_in = bool(plan.swap_out) and not (
        in_cpu.isdisjoint(c for _, c in plan.swap_out)
        and in_gpu.isdisjoint(g for g, _ in plan.swap_out))
    return after, out_after_in
