"""LLMEngine: an :class:`EngineCore` assembled from an :class:`EngineConfig`.

It loads the model (or, under tensor parallelism, starts the ranks that do), sizes both tiers
(``engine.tiers``), picks the retention cost model, and composes the scheduler, the cache and
the executor: :class:`~pensieve.engine.local.LocalExecutor` for one device,
:class:`~pensieve.parallel.tp_executor.TPExecutor` for ``tensor_parallel_size > 1``. Stepping is
:class:`EngineCore`'s; the engine owns no policy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from pensieve.config import EngineConfig, swap_chunk_seconds
from pensieve.core.eviction import EvictionPolicy, get_policy
from pensieve.core.outputs import SchedulerOutput
from pensieve.core.scheduler import Scheduler
from pensieve.core.scheduling_config import SchedulerConfig
from pensieve.core.tiered_cache import TieredKVCache
from pensieve.engine.costs import load_cost_model
from pensieve.engine.disk_build import build_disk_tier
from pensieve.engine.engine_core import EngineCore, StepObserver
from pensieve.engine.executor import Executor
from pensieve.engine.local import LocalExecutor, resolve_device, resolve_dtype
from pensieve.engine.tiers import build_cache, check_fits
from pensieve.models import check_max_model_len
from pensieve.models.loader import load_model, resolve_config

log = logging.getLogger("pensieve")

__all__ = ["LLMEngine", "resolve_device", "resolve_dtype"]


class LLMEngine(EngineCore):
    """A model (on one device, or split over ranks) with its paged KV cache and scheduler."""

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic,
                 observers: Iterable[StepObserver] = ()) -> None:
        self.config = config
        mc, cc = config.model, config.cache
        self.device = resolve_device(mc.device)
        torch.manual_seed(mc.seed)
        hf_config, path = resolve_config(mc.model)
        check_max_model_len(hf_config, config.scheduler.max_model_len)
        load_format = mc.load_format
        if path is None and load_format == "auto":
            load_format = "dummy"  # a preset shape has no checkpoint
        executor: Executor
        if mc.tensor_parallel_size > 1:
            from pensieve.parallel.tp_executor import TPExecutor

            self.hf_config: Any = hf_config
            self.dtype = resolve_dtype(mc.dtype, self.device, hf_config)
            tp = TPExecutor(config, path or hf_config, hf_config, self.dtype, load_format,
                            self.device)
            self.model: Any = tp.model  # weightless (meta device): shapes only
            executor = tp
        else:
            t0 = time.perf_counter()
            self.model, self.hf_config = load_model(
                path or hf_config, dtype=resolve_dtype(mc.dtype, self.device, hf_config),
                device=self.device, load_format=load_format, seed=mc.seed,
            )
            log.info("model loaded in %.1f s", time.perf_counter() - t0)
            self.dtype = next(self.model.parameters()).dtype
            executor = LocalExecutor(config, self.model, self.hf_config, self.device)
        too_long = check_fits(config.scheduler.max_model_len, cc.chunk_size, executor.tiers)
        if too_long:
            log.warning("%s; a turn that grows past the tier is ended with an error", too_long)
        self.block_bytes = executor.tiers.block_bytes
        """One rank's bytes per chunk (under tensor parallelism the ranks copy their slices
        at once, each on its link)."""
        self.cost_model = load_cost_model(cc.cost_profile, self.hf_config, cc.chunk_size,
                                          self.device, self.dtype)
        bw = cc.swap_bandwidth(self.device.type)
        self.swap_chunk_s = swap_chunk_seconds(self.block_bytes, bw)
        """Seconds to move one chunk one way between the tiers (one rank's slice under tensor
        parallelism) at ``swap_bandwidth_gbps``; None: the cache always swaps in."""
        if self.swap_chunk_s is not None:
            log.info("swap vs recompute: %.1f GB/s one way, %.1f us per chunk (%d bytes)", bw,
                     self.swap_chunk_s * 1e6, self.block_bytes)
        eos = getattr(self.hf_config, "eos_token_id", None)
        eos_ids: tuple[int, ...] = (
            () if eos is None else tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)
        )
        self.disk_tier = build_disk_tier(cc, config.model.model, executor, self.model, self.dtype)
        """The disk tier below the CPU tier (``CacheConfig.disk_kv_gb``); None: none."""
        scheduler = Scheduler(config.scheduler, self._make_cache(executor, cc.policy))
        device = self.device
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
        super().__init__(scheduler, executor, clock=clock, eos_token_ids=eos_ids,
                         vocab_size=int(self.hf_config.vocab_size), observers=observers,
                         disk=self.disk_tier,
                         disk_sync=sync if self.disk_tier is not None else None)

    @property
    def runner(self) -> Any:
        """The local executor's :class:`ModelRunner` (under tensor parallelism: the
        :class:`TPExecutor`, whose ranks hold the runners)."""
        return getattr(self.executor, "runner", self.executor)

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """The device KV tensors of this process (none under tensor parallelism)."""
        runner = getattr(self.executor, "runner", None)
        return runner.kv_caches if runner is not None else []

    def _make_cache(self, executor: Executor, policy: EvictionPolicy) -> TieredKVCache:
        return build_cache(executor.tiers, self.cost_model, self.config.cache, policy=policy,
                           swap_chunk_s=self.swap_chunk_s,
                           disk=self.disk_tier.index if self.disk_tier is not None else None)

    def reset(self, cache_policy: str | EvictionPolicy | None = None,
              scheduler_config: SchedulerConfig | None = None) -> None:
        """Forget every request and conversation and start with empty tiers, optionally under
        another cache policy or scheduler config; the model, the KV tensors and the pinned CPU
        tier are kept (the benchmark runs many points on one engine). The CPU tier keeps the
        size it was built with (none if the engine was built with a policy that has no CPU
        tier). Copies still in flight finish first (an empty step waits for them): the new
        cache may hand their blocks out at once."""
        policy = (self.cache.policy if cache_policy is None
                  else cache_policy if isinstance(cache_policy, EvictionPolicy)
                  else get_policy(cache_policy))
        sc = scheduler_config or self.scheduler_config
        for rid in list(self.scheduler.requests):
            self.scheduler.abort_request(rid, self.now())
        self.executor.execute(SchedulerOutput(requests=[]))
        self.replace_scheduler(Scheduler(sc, self._make_cache(self.executor, policy)))
