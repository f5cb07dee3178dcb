"""Simulated engine: Pensieve's scheduler and tiered cache, with a cost model instead of a GPU.

:class:`SimEngine` implements :class:`~pensieve.bench.engine_api.BenchEngine`. It builds the
same :class:`~pensieve.core.scheduler.Scheduler` over the same
:class:`~pensieve.core.tiered_cache.TieredKVCache` that :class:`~pensieve.engine.llm_engine.
LLMEngine` builds (any cache policy; block counts only, no tensors), over another executor,
:class:`SimExecutor`, which moves a clock forward by :meth:`StepCostModel.predict` of each step's
:class:`~pensieve.sim.step_cost.StepFeatures`. One step::

    sched = scheduler.schedule(now)              # the real admission, eviction and swap plans
    compute = step_cost.compute_time(features_of(sched))   # calibrated (or analytic) compute
    copies = transfers.step(now, sched.swaps, compute)     # measured rates, copy streams
    dt = compute + copies.exposed_copy_s
    clock.sleep_until(now + dt)                  # a VirtualClock jumps; a WallClock would wait
    scheduler.update_from_output(sched, <token 0 for every sampling request,
                                         copies.swap_outs_in_flight>, clock.now())

Tier copies (:class:`~pensieve.sim.step_cost.TransferModel`, default 45 GB/s each way, or
``TransferModel.load`` of a measured JSON such as ``docs/results/swap/swap_bandwidth.json``): the
step waits for its urgent swap-outs in full and for its swap-ins only beyond its compute
(pipelined per layer; ``pipelined=False`` for steps replayed from CUDA graphs, which the
runner makes wait for every swap-in first); background swap-outs run concurrently on the
host-bound direction and may outlive the step, and the step reports how many batches are still
copying (``RunnerOutput.swap_outs_in_flight``), as the runner does, so the cache reclaims their
GPU blocks only once the simulated copy is done. The fitted ``swap_copy_chunk_s`` and
``per_swap_chunk_s`` of the step-cost model (the copies before the swap kernel) are not used
then; ``transfer=None`` restores them (every copy done within its step, as before).

With ``disk_kv_gb`` a disk tier lies below the CPU tier (:mod:`pensieve.sim.disk`): the
core's disk index and plans, reads and writes on simulated time at the disk's rates; a step
waits, before it schedules, for the reads its turns started (the clock jumps).

Every step is also kept as a :class:`SimStepRecord` (:attr:`SimExecutor.step_records`): what
the host of the real engine sees of a step (``pensieve.engine.step_record.StepRecord``'s
token and swap counts, same definitions) plus the cache's token sources of the turns admitted
in it and the simulated exposed copy time.

Every sampled token is ``sample_token_id`` (0 by default, not an end-of-sequence id: the
simulator has no EOS unless ``eos_token_ids`` is given), so a turn runs to ``max_tokens`` (or
``max_model_len``) as the benchmark's ``ignore_eos`` turns do on the real engine; its history,
as kept by the cache, is its context followed by those tokens.

Pure Python: importing this module loads neither torch nor numpy (``RequestOutput`` comes from
the torch-free ``pensieve.engine.request_output``); it takes any clock with ``now()`` and
``sleep_until()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Protocol

from pensieve.config import CacheConfig, EngineConfig
from pensieve.core.cost_model import CostModel
from pensieve.core.disk_index import require_cpu_tier
from pensieve.core.eviction import EvictionPolicy, get_policy
from pensieve.core.outputs import RunnerOutput, SchedulerOutput
from pensieve.core.scheduler import Scheduler
from pensieve.core.scheduling_config import SchedulerConfig
from pensieve.core.tiered_cache import TieredKVCache
from pensieve.engine.engine_core import EngineCore
from pensieve.engine.executor import TierSizes
from pensieve.engine.step_record import prefill_decode_tokens
from pensieve.engine.tiers import SIM, build_cache, tier_sizes
from pensieve.sim.disk import (
    SIM_DISK_PATH,
    SIM_DISK_READ_GBPS,
    SIM_DISK_WRITE_GBPS,
    SimDiskTier,
)
from pensieve.sim.step_cost import (
    StepCostModel,
    StepFeatures,
    TransferModel,
    TransferTimeline,
    features_of,
)


class SimClock(Protocol):
    """What the simulator needs of a clock (:class:`~pensieve.bench.engine_api.VirtualClock`
    has it; so does ``WallClock``, which makes the simulator run in real time)."""

    def now(self) -> float: ...

    def sleep_until(self, t: float) -> None: ...


DEFAULT_TRANSFER = TransferModel(source="default")
"""45 GB/s each way, no launch latency, swap-ins pipelined with the compute."""


@dataclass(frozen=True, slots=True)
class SimStepRecord:
    """One simulated step, with what the real engine's host records of a step (the same
    names and definitions as ``pensieve.engine.step_record.StepRecord``) and what only the
    simulator knows (the compute and exposed copy time, when background copies end)."""

    start_s: float
    """Clock reading when the step began."""
    step_time_s: float
    """Simulated duration: ``compute_s + exposed_copy_s``."""
    compute_s: float
    exposed_copy_s: float
    """Copy time the step waited for beyond its compute (urgent swap-outs, swap-ins beyond
    the compute, waits for batches in flight)."""
    num_requests: int
    prefill_tokens: int
    """Tokens computed in ranges that are not a decode (new input, recomputed history)."""
    decode_tokens: int
    cached_tokens: int
    """Context tokens of the turns admitted in this step whose KV was reused rather than
    computed (``gpu_hit_tokens + cpu_hit_tokens``)."""
    gpu_hit_tokens: int
    cpu_hit_tokens: int
    recomputed_tokens: int
    cpu_recomputed_tokens: int
    """Of ``recomputed_tokens``: tokens on the CPU tier recomputed rather than swapped in
    (the cache's swap-or-recompute choice; 0 where the cache does not count them)."""
    new_prompt_tokens: int
    dropped_tokens: int
    swap_in_chunks: int
    swap_out_chunks: int
    """Background (ahead-of-time) swap-outs planned in this step."""
    urgent_swap_out_chunks: int
    swap_outs_in_flight: int
    """Background batches still copying when the step ended (this step's included)."""
    background_done_at: float | None
    """When this step's background batch completes (None: it had none)."""

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_SOURCES = ("gpu_hit_tokens", "cpu_hit_tokens", "recomputed_tokens", "cpu_recomputed_tokens",
            "new_prompt_tokens", "dropped_tokens")


class SimExecutor:
    """The simulator's :class:`~pensieve.engine.executor.Executor`: each step moves ``clock``
    forward by the step-cost model's prediction (module docstring) and samples
    ``sample_token_id`` for every sampling request."""

    def __init__(self, tiers: TierSizes, step_cost: StepCostModel, clock: SimClock,
                 sample_token_id: int = 0,
                 transfer: TransferModel | None = DEFAULT_TRANSFER,
                 step_time: Callable[[SchedulerOutput], float] | None = None) -> None:
        self._tiers = tiers
        self.step_time = step_time
        """Seconds of a step from its schedule, in place of ``step_cost`` and the copies (the
        ideal bound, :class:`~pensieve.sim.ideal.IdealStepTime`; None: the step-cost model)."""
        self.clock = clock
        self.step_cost = step_cost
        self.sample_token_id = sample_token_id
        self.transfer = transfer
        self.transfers = (TransferTimeline(transfer, tiers.block_bytes)
                          if transfer is not None else None)
        """The copy streams' state across steps (None: copies within each step)."""
        self.cache: TieredKVCache | None = None
        """The cache whose token sources :class:`SimStepRecord` reports (set by the engine)."""
        self.swap_in_chunks = 0
        self.swap_out_chunks = 0
        self.busy_time_s = 0.0
        """Simulated time spent in steps (the rest of the clock's advance is idle waiting)."""
        self.step_log: list[tuple[StepFeatures, float]] = []
        """``(features, simulated seconds)`` of every step, in order (same shape as the
        records :meth:`StepCostModel.fit` takes)."""
        self.step_start_times: list[float] = []
        """Clock reading at the start of each step of :attr:`step_log`."""
        self.step_records: list[SimStepRecord] = []
        """One :class:`SimStepRecord` per step, in order."""
        self.exposed_copy_s = 0.0
        """Total simulated time steps waited for copies beyond their compute."""
        self._sources_of: object = None
        self._sources_last: dict[str, int] = {}
        self._loaded: dict[str, tuple[int, int]] = {}
        """request id -> context positions ``[lo, hi)`` whose KV a shared tier delivers."""

    def load_from_shared(self, request_id: str, lo: int, hi: int) -> None:
        """Positions ``[lo, hi)`` of ``request_id``'s context arrive from a shared tier (a
        transfer the caller timed): its steps do not compute them (:func:`features_of`)."""
        if hi > lo:
            self._loaded[request_id] = (lo, hi)

    def loaded_span(self, request_id: str) -> tuple[int, int] | None:
        """The :meth:`load_from_shared` range of ``request_id`` (None: none)."""
        return self._loaded.get(request_id)

    def forget_loaded(self, request_id: str) -> None:
        """``request_id`` is done: drop its :meth:`load_from_shared` range."""
        self._loaded.pop(request_id, None)

    @property
    def tiers(self) -> TierSizes:
        return self._tiers

    def stats(self) -> dict[str, int]:
        """Swap bytes: the chunks moved times ``block_bytes``."""
        bb = self._tiers.block_bytes
        return {"swap_in_bytes": self.swap_in_chunks * bb,
                "swap_out_bytes": self.swap_out_chunks * bb}

    def shutdown(self) -> None:
        """Nothing to release."""

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Advance the clock by the predicted step time; one token per sampling request."""
        start = self.clock.now()
        feats = features_of(sched, self._loaded)
        compute = self.step_cost.compute_time(feats)
        in_flight = 0
        done_at: float | None = None
        if self.step_time is not None:  # the ideal: no copy waits, no host time
            compute = dt = self.step_time(sched)
        elif self.transfers is None:
            dt = self.step_cost.predict(feats)
        else:
            n = sched.num_scheduled_tokens
            eager = self.transfers.model.eager_extra_s(n, len(sched.swaps.swap_in))
            compute += eager  # the eager launch of a step the graphs would have replayed
            tr = self.transfers.step(start, sched.swaps, compute, n)
            feats = dataclasses.replace(feats, exposed_copy_s=tr.exposed_copy_s)
            dt = self.step_cost.predict(feats) + eager  # compute + exposed copy time
            in_flight, done_at = tr.swap_outs_in_flight, tr.background_done_at
        self.clock.sleep_until(start + dt)
        self.step_log.append((feats, dt))
        self.step_start_times.append(start)
        self.busy_time_s += dt
        self.exposed_copy_s += dt - compute
        self.swap_in_chunks += sched.swaps.num_swap_in_chunks
        self.swap_out_chunks += feats.swap_out_chunks
        self.step_records.append(self._record(sched, start, dt, compute, in_flight, done_at))
        sampled = {s.request_id: self.sample_token_id for s in sched.requests if s.sample}
        return RunnerOutput(sampled_token_ids=sampled, step_time_s=dt,
                            swap_outs_in_flight=in_flight)

    def _record(self, sched: SchedulerOutput, start: float, dt: float, compute: float,
                in_flight: int, done_at: float | None) -> SimStepRecord:
        stats = self.cache.stats if self.cache is not None else None
        now = {k: int(getattr(stats, k, 0)) for k in _SOURCES}
        if stats is not self._sources_of:  # a new cache: its counters start at zero
            self._sources_of, self._sources_last = stats, dict.fromkeys(_SOURCES, 0)
        d = {k: now[k] - self._sources_last[k] for k in _SOURCES}
        self._sources_last = now
        prefill, decode = prefill_decode_tokens(sched)
        sw = sched.swaps
        return SimStepRecord(
            start_s=start, step_time_s=dt, compute_s=compute, exposed_copy_s=dt - compute,
            num_requests=len(sched.requests), prefill_tokens=prefill, decode_tokens=decode,
            cached_tokens=d["gpu_hit_tokens"] + d["cpu_hit_tokens"], **d,
            swap_in_chunks=sw.num_swap_in_chunks, swap_out_chunks=len(sw.swap_out),
            urgent_swap_out_chunks=len(sw.swap_out_first), swap_outs_in_flight=in_flight,
            background_done_at=done_at)


class SimEngine(EngineCore):
    """The scheduler and the tiered cache of Pensieve over a :class:`SimExecutor`."""

    executor: SimExecutor

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        step_cost: StepCostModel,
        clock: SimClock,
        chunk_cost: CostModel | Callable[[int], float],
        chunk_size: int = CacheConfig.chunk_size,
        cache_policy: str | EvictionPolicy = "pensieve",
        swap_out_threshold: float = CacheConfig.swap_out_threshold,
        decode_reserve: float = CacheConfig.decode_reserve,
        block_bytes: int = 0,
        eos_token_ids: tuple[int, ...] = (),
        sample_token_id: int = 0,
        vocab_size: int | None = None,
        transfer: TransferModel | None = DEFAULT_TRANSFER,
        swap_bandwidth_gbps: float | str | None = "auto",
        defer_admission: int = CacheConfig.defer_admission,
        share_prefixes: bool = CacheConfig.share_prefixes,
        disk_kv_gb: float | None = None,
        disk_read_gbps: float | None = None,
        disk_write_gbps: float = SIM_DISK_WRITE_GBPS,
        disk_prefetch: str = "worth-reading",
        disk_wait: str = "running",
        step_time: Callable[[SchedulerOutput], float] | None = None,
    ) -> None:
        """``chunk_cost``: the retention value's Cost(l) (a :class:`CostModel`, whose chunk
        size must match, or any function of the context length). ``cache_policy``: a policy
        name, or a policy object (the clairvoyant ``OraclePolicy``). ``block_bytes``: K+V bytes of
        one chunk over all layers: the bytes each swapped chunk moves (copy times) and the
        ``swap_in_bytes`` / ``swap_out_bytes`` reported (0: copies take no time).
        ``vocab_size``: if given, prompt token ids are checked against it as the engine does.
        ``transfer``: the copy model (module docstring); None: the step-cost model's own swap
        terms, every copy done within its step. ``swap_bandwidth_gbps``: the rate the cache
        weighs swap-in against recomputation with, as ``CacheConfig.swap_bandwidth_gbps`` does
        on the engine: ``"auto"`` the transfer model's swap-in rate (off without a transfer
        model or ``block_bytes``), ``"off"``/None always swap in, or a number of GB/s.
        ``share_prefixes``: the cache holds equal full chunks once (``CacheConfig.share_prefixes``;
        the prompts' token ids decide, as on the engine). ``disk_kv_gb``: a disk tier of that
        many GiB below the CPU tier (:class:`~pensieve.sim.disk.SimDiskTier`: the core's
        disk index, reads and writes on simulated time at ``disk_read_gbps``, default
        :data:`~pensieve.sim.disk.SIM_DISK_READ_GBPS`, and ``disk_write_gbps``;
        ``disk_prefetch``: which files a turn reads, ``"worth-reading"`` as the engine, or
        the what-if ``"all"``; ``disk_wait``: when a step waits for reads, ``"running"`` as
        the engine, or the what-if ``"always"``). ``step_time``: seconds of a step from its
        schedule, replacing ``step_cost`` and the copy model (the ideal bound,
        :mod:`pensieve.sim.ideal`)."""
        if isinstance(chunk_cost, CostModel) and chunk_cost.chunk_size != chunk_size:
            raise ValueError(f"cost model is for chunk_size {chunk_cost.chunk_size}, the "
                             f"simulator uses {chunk_size}")
        if sample_token_id in eos_token_ids:
            raise ValueError(f"sample_token_id {sample_token_id} is an EOS id")
        if block_bytes < 0:
            raise ValueError(f"block_bytes must be >= 0, got {block_bytes}")
        tiers = TierSizes(num_gpu_blocks, num_cpu_blocks, block_bytes)
        self.swap_chunk_s = _swap_chunk_s(swap_bandwidth_gbps, transfer, block_bytes)
        """Seconds per chunk the cache weighs swap-in against recomputation with (None:
        always swap in), as ``LLMEngine.swap_chunk_s``."""
        policy = (cache_policy if isinstance(cache_policy, EvictionPolicy)
                  else get_policy(cache_policy))
        self.sim_disk = (_sim_disk(disk_kv_gb, disk_read_gbps, disk_write_gbps, tiers,
                                   chunk_size, clock, disk_prefetch, disk_wait)
                         if disk_kv_gb else None)
        """The simulated disk tier (None: none); also the engine's ``disk``."""
        cc = CacheConfig(chunk_size=chunk_size, swap_out_threshold=swap_out_threshold,
                         decode_reserve=decode_reserve, defer_admission=defer_admission,
                         share_prefixes=share_prefixes,
                         cache_policy=cache_policy if isinstance(cache_policy, str)
                         else "pensieve")
        cache = build_cache(tiers, chunk_cost, cc, policy=policy, swap_chunk_s=self.swap_chunk_s,
                            disk=self.sim_disk.index if self.sim_disk is not None else None)
        executor = SimExecutor(tiers, step_cost, clock, sample_token_id, transfer, step_time)
        executor.cache = cache
        super().__init__(Scheduler(scheduler_config, cache), executor, clock=clock.now,
                         eos_token_ids=tuple(eos_token_ids), vocab_size=vocab_size,
                         disk=self.sim_disk)

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
        """Tiers sized as the engine would from an :class:`~pensieve.config.EngineConfig`
        (:func:`~pensieve.engine.tiers.tier_sizes`: exact block counts, or GiB sizes divided by
        ``block_bytes``; memory left after the weights has to be given as ``num_gpu_blocks``).
        """
        cc = config.cache
        tiers = tier_sizes(config, block_bytes, SIM)
        kw.setdefault("swap_bandwidth_gbps", cc.swap_bandwidth_gbps)
        kw.setdefault("defer_admission", cc.defer_admission)
        kw.setdefault("share_prefixes", cc.share_prefixes)
        kw.setdefault("disk_kv_gb", cc.disk_kv_gb)
        kw.setdefault("disk_read_gbps", cc.disk_read_gbps)
        return cls(config.scheduler, tiers.num_gpu_blocks, tiers.num_cpu_blocks, step_cost,
                   clock, chunk_cost, chunk_size=cc.chunk_size, cache_policy=cc.policy,
                   swap_out_threshold=cc.swap_out_threshold, decode_reserve=cc.decode_reserve,
                   block_bytes=tiers.block_bytes, **kw)

    @classmethod
    def from_options(
        cls,
        options: Mapping[str, Any],
        step_cost: StepCostModel,
        clock: SimClock,
        chunk_cost: CostModel | Callable[[int], float],
        block_bytes: int | None = None,
        **kw: Any,
    ) -> SimEngine:
        """:meth:`from_config` of flat engine options (a command line's,
        :func:`pensieve.options.engine_options`), with no device's defaults settled: the
        simulator models its own device (:meth:`EngineConfig.from_options`). A disk tier
        (``disk_kv_gb``) needs no ``disk_kv_path``: :data:`~pensieve.sim.disk.
        SIM_DISK_PATH` stands in for the config's check, and no file is opened."""
        if options.get("disk_kv_gb") and not options.get("disk_kv_path"):
            options = {**options, "disk_kv_path": SIM_DISK_PATH}
        return cls.from_config(EngineConfig.from_options(**options), step_cost, clock,
                               chunk_cost, block_bytes=block_bytes, **kw)


def _sim_disk(gib: float, read_gbps: float | None, write_gbps: float, tiers: TierSizes,
              chunk_size: int, clock: SimClock, prefetch: str, wait: str) -> SimDiskTier:
    """The simulated disk tier of ``gib`` GiB over ``tiers``' chunks (the engine's checks:
    a CPU tier below which it lies, chunks of known bytes)."""
    require_cpu_tier(tiers.num_cpu_blocks)
    if tiers.block_bytes <= 0:
        raise ValueError("a simulated disk tier needs block_bytes > 0")
    capacity = int(gib * 2**30 // tiers.block_bytes)
    return SimDiskTier(capacity, chunk_size, tiers.block_bytes, clock,
                       read_gbps=read_gbps if read_gbps is not None else SIM_DISK_READ_GBPS,
                       write_gbps=write_gbps, prefetch=prefetch, wait=wait)


def _swap_chunk_s(bandwidth: float | str | None, transfer: TransferModel | None,
                  block_bytes: int) -> float | None:
    if bandwidth == "auto":
        if transfer is None or block_bytes <= 0:
            return None
        return transfer.in_seconds(block_bytes)
    if bandwidth is None or bandwidth == "off":
        return None
    if isinstance(bandwidth, str) or isinstance(bandwidth, bool) or not bandwidth > 0:
        raise ValueError(f"swap_bandwidth_gbps must be a positive number of GB/s, 'auto' or "
                         f"'off', got {bandwidth!r}")
    if block_bytes <= 0:
        raise ValueError("a swap_bandwidth_gbps needs block_bytes > 0")
    return block_bytes / (float(bandwidth) * 1e9)


__all__ = ["DEFAULT_TRANSFER", "SimClock", "SimEngine", "SimExecutor", "SimStepRecord",
           "prefill_decode_tokens"]
