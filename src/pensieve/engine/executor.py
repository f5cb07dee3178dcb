"""The Executor protocol: what :class:`~pensieve.engine.engine_core.EngineCore` needs of whatever
runs its steps. No torch here.

Three executors implement it:

- :class:`~pensieve.engine.local.LocalExecutor`: one :class:`~pensieve.runner.model_runner.
  ModelRunner` in this process (a model on one device with its KV tiers);
- :class:`~pensieve.parallel.tp_executor.TPExecutor`: ``tensor_parallel_size`` rank processes,
  each a ``ModelRunner`` over its shard (built by the same functions as the local one);
- :class:`~pensieve.sim.simulator.SimExecutor`: no model, a clock moved by a step-cost model.

Contract of :meth:`Executor.execute`: it runs the plan's swaps, then the step's query ranges,
and samples; or it raises. An executor that raises after it issued the plan's copies must
still be able to run later steps: :class:`EngineCore` then re-runs the step's requests in
smaller groups without the copies (``engine.containment``). ``execute`` of a plan without
requests waits for every copy in flight and reports none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pensieve.core.outputs import RunnerOutput, SchedulerOutput


@dataclass(frozen=True)
class TierSizes:
    """Blocks per tier (per rank under tensor parallelism: every rank holds the same ids) and
    the bytes of one block (K and V of one chunk over all layers, one rank's slice)."""

    num_gpu_blocks: int
    num_cpu_blocks: int
    block_bytes: int

    def __post_init__(self) -> None:
        if self.num_gpu_blocks < 1 or self.num_cpu_blocks < 0 or self.block_bytes < 0:
            raise ValueError(f"invalid tier sizes: {self}")


class Executor(Protocol):
    """Runs one :class:`SchedulerOutput` at a time; the engine holds one."""

    @property
    def tiers(self) -> TierSizes:
        """The blocks it holds: the cache's block ids index these tiers."""
        ...

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run one step (swaps, ranges, sampling); see the module docstring."""
        ...

    def stats(self) -> dict[str, int]:
        """Running totals since start: ``swap_in_bytes`` and ``swap_out_bytes`` (all ranks)."""
        ...

    def shutdown(self) -> None:
        """Release processes and devices; idempotent (a no-op where there are none)."""
        ...
