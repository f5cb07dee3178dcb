"""Simulated engine: Pensieve's scheduler and tiered cache, with a cost model instead of a GPU.

:class:`SimEngine` implements :class:`~pensieve.bench.engine_api.BenchEngine`. It builds the
same :class:`~pensieve.core.scheduler.Scheduler` over the same
:class:`~pensieve.core.tiered_cache.TieredKVCache` that :class:`~pensieve.engine.llm_engine.
LLMEngine` builds (any cache policy; block counts only, no tensors), and replaces the runner by
an executor that moves a clock forward by :meth:`StepCostModel.predict` of each step's
:class:`~pensieve.bench.step_cost.StepFeatures`. One step::

    sched = scheduler.schedule(now)              # the real admission, eviction and swap plans
    dt = step_cost.predict(features_of(sched))   # calibrated (or analytic) step time
    clock.sleep_until(now + dt)                  # a VirtualClock jumps; a WallClock would wait
    scheduler.update_from_output(sched, <token 0 for every sampling request>, clock.now())

Every sampled token is ``sample_token_id`` (0 by default, not an end-of-sequence id: the
simulator has no EOS unless ``eos_token_ids`` is given), so a turn runs to ``max_tokens`` (or
``max_model_len``) as the benchmark's ``ignore_eos`` turns do on the real engine; its history,
as kept by the cache, is its context followed by those tokens.

Pure Python: importing this module loads neither torch nor numpy (``RequestOutput`` comes from
the torch-free ``pensieve.engine.outputs``); it takes any clock with ``now()`` and
``sleep_until()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from pensieve.bench.step_cost import StepCostModel, StepFeatures, features_of
from pensieve.core.config import SchedulerConfig
from pensieve.core.cost_model import CostModel
from pensieve.core.eviction import get_policy
from pensieve.core.outputs import RunnerOutput, SchedulerOutput
from pensieve.core.tiered_cache import TieredKVCache
from pensieve.engine.core import EngineCore

if TYPE_CHECKING:
    from pensieve.config import EngineConfig


class SimClock(Protocol):
    """What the simulator needs of a clock (:class:`~pensieve.bench.engine_api.VirtualClock`
    has it; so does ``WallClock``, which makes the simulator run in real time)."""

    def now(self) -> float: ...

    def sleep_until(self, t: float) -> None: ...


class SimEngine(EngineCore):
    """The scheduler and the tiered cache of Pensieve, stepped on a simulated clock."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        step_cost: StepCostModel,
        clock: SimClock,
        chunk_cost: CostModel | Callable[[int], float],
        chunk_size: int = 32,
        cache_policy: str = "pensieve",
        swap_out_threshold: float = 0.25,
        decode_reserve: float = 0.10,
        block_bytes: int = 0,
        eos_token_ids: tuple[int, ...] = (),
        sample_token_id: int = 0,
        vocab_size: int | None = None,
    ) -> None:
        """``chunk_cost``: the retention value's Cost(l) (a :class:`CostModel`, whose chunk
        size must match, or any function of the context length). ``block_bytes``: K+V bytes of
        one chunk over all layers, only to report ``swap_in_bytes`` / ``swap_out_bytes``.
        ``vocab_size``: if given, prompt token ids are checked against it as the engine does."""
        if isinstance(chunk_cost, CostModel):
            if chunk_cost.chunk_size != chunk_size:
                raise ValueError(f"cost model is for chunk_size {chunk_cost.chunk_size}, the "
                                 f"simulator uses {chunk_size}")
            cost_fn: Callable[[int], float] = chunk_cost.chunk_cost
        else:
            cost_fn = chunk_cost
        if sample_token_id in eos_token_ids:
            raise ValueError(f"sample_token_id {sample_token_id} is an EOS id")
        self.clock = clock
        self.step_cost = step_cost
        self.block_bytes = block_bytes
        self.sample_token_id = sample_token_id
        # As LLMEngine.__init__ builds them (minus the tensors).
        policy = get_policy(cache_policy)
        num_cpu_blocks = num_cpu_blocks if policy.uses_cpu_tier else 0
        self._init_core(scheduler_config,
                        TieredKVCache(num_gpu_blocks, num_cpu_blocks, chunk_size, policy, cost_fn,
                                      swap_out_threshold, decode_reserve),
                        clock.now, tuple(eos_token_ids), vocab_size)
        self.swap_in_chunks = 0
        self.swap_out_chunks = 0
        self.busy_time_s = 0.0
        """Simulated time spent in steps (the rest of the clock's advance is idle waiting)."""
        self.step_log: list[tuple[StepFeatures, float]] = []
        """``(features, simulated seconds)`` of every step, in order (same shape as the
        records :meth:`StepCostModel.fit` takes)."""
        self.step_start_times: list[float] = []
        """Clock reading at the start of each step of :attr:`step_log`."""

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        step_cost: StepCostModel,
        clock: SimClock,
        chunk_cost: CostModel | Callable[[int], float],
        block_bytes: int | None = None,
        **kw: Any,
    ) -> SimEngine:
        """Tiers sized as the engine would from an :class:`~pensieve.config.EngineConfig`:
        exact block counts, or GiB sizes divided by ``block_bytes`` (device-free sizing, i.e.
        memory left after the weights, has to be turned into ``num_gpu_blocks`` by the caller).
        """
        cc = config.cache
        gpu = cc.num_gpu_blocks
        if gpu is None:
            if cc.gpu_kv_gb is None or not block_bytes:
                raise ValueError("the simulator needs num_gpu_blocks, or gpu_kv_gb and "
                                 "block_bytes")
            gpu = max(1, int(cc.gpu_kv_gb * 2**30 // block_bytes))
        cpu = cc.num_cpu_blocks
        if cpu is None:
            if cc.cpu_kv_gb is None or not block_bytes:
                raise ValueError("the simulator needs num_cpu_blocks, or cpu_kv_gb and "
                                 "block_bytes")
            cpu = int(cc.cpu_kv_gb * 2**30 // block_bytes)
        return cls(config.scheduler, gpu, cpu, step_cost, clock, chunk_cost,
                   chunk_size=cc.chunk_size, cache_policy=cc.cache_policy,
                   swap_out_threshold=cc.swap_out_threshold, decode_reserve=cc.decode_reserve,
                   block_bytes=block_bytes or 0, **kw)

    def cache_stats(self) -> dict[str, int]:
        """The keys of ``LLMEngine.cache_stats`` (swap bytes from ``block_bytes``)."""
        return self._core_stats(self.swap_in_chunks * self.block_bytes,
                                self.swap_out_chunks * self.block_bytes)

    # ---------------------------------------------------------------- a step
    def _execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Advance the clock by the predicted step time; one token per sampling request."""
        start = self.clock.now()
        feats = features_of(sched)
        dt = self.step_cost.predict(feats)
        self.clock.sleep_until(start + dt)
        self.step_log.append((feats, dt))
        self.step_start_times.append(start)
        self.busy_time_s += dt
        self.swap_in_chunks += feats.swap_in_chunks
        self.swap_out_chunks += feats.swap_out_chunks
        sampled = {s.request_id: self.sample_token_id for s in sched.requests if s.sample}
        return RunnerOutput(sampled_token_ids=sampled, step_time_s=dt)


__all__ = ["SimClock", "SimEngine"]
