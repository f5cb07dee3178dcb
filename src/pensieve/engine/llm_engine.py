"""LLMEngine: load the model, size the KV cache, and step scheduler + runner.

One step = ``scheduler.schedule()`` -> ``runner.execute()`` -> ``scheduler.update_from_output()``.
The engine owns no policy; it only wires the pieces and converts finished requests to outputs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pensieve.config import EngineConfig, swap_chunk_seconds
from pensieve.core.eviction import get_policy
from pensieve.core.outputs import RunnerOutput, SchedulerOutput
from pensieve.core.tiered_cache import TieredKVCache
from pensieve.engine.core import EngineCore
from pensieve.engine.costs import load_cost_model
from pensieve.models.loader import load_model, resolve_config
from pensieve.runner.model_runner import ModelRunner, allocate_kv_caches, kv_bytes_per_block

if TYPE_CHECKING:
    from pensieve.parallel.executor import TPExecutor

log = logging.getLogger("pensieve")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
           "half": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available")
    return dev


def resolve_dtype(dtype: str, device: torch.device, hf_config: object) -> torch.dtype:
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(ckpt, str):
            ckpt = _DTYPES.get(ckpt)
        return ckpt if ckpt in (torch.float16, torch.bfloat16) else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of float32, float16, bfloat16, auto")
    return _DTYPES[dtype]


def size_cpu_tier(config: EngineConfig, device: torch.device, block_bytes: int) -> int:
    """CPU-tier blocks of ``block_bytes`` each (per rank under tensor parallelism)."""
    cc = config.cache
    if cc.num_cpu_blocks is not None:
        return cc.num_cpu_blocks
    gb = cc.cpu_kv_gb if cc.cpu_kv_gb is not None else (32.0 if device.type == "cuda" else 1.0)
    return int(gb * 2**30 // block_bytes)


def size_gpu_tier(config: EngineConfig, device: torch.device, hf_config: object,
                  dtype: torch.dtype, block_bytes: int) -> int:
    """GPU-tier blocks of ``block_bytes`` each: the configured count or size, else what fits in
    ``device``'s free memory (call it after the weights are loaded)."""
    cc, sc = config.cache, config.scheduler
    if cc.num_gpu_blocks is not None:
        return cc.num_gpu_blocks
    if cc.gpu_kv_gb is not None:
        return max(1, int(cc.gpu_kv_gb * 2**30 // block_bytes))
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        hidden = int(getattr(hf_config, "hidden_size", 4096))
        inter = int(getattr(hf_config, "intermediate_size", None)
                    or getattr(hf_config, "ffn_dim", 4 * hidden))
        vocab = int(hf_config.vocab_size)  # type: ignore[attr-defined]
        elem = torch.empty((), dtype=dtype).element_size()
        activations = sc.max_num_batched_tokens * (8 * hidden + 3 * inter) * elem
        activations += sc.max_num_seqs * vocab * 4 * 3 + 2**30
        if config.mixed_graph_shape(device.type) is not None:
            activations *= 2  # the mixed-step graphs' pool, beside the eager allocator's
        budget = free - (1 - cc.gpu_memory_utilization) * total - activations
        return max(1, int(budget // block_bytes))
    # CPU: enough for every running request to reach max_model_len, at most 2 GiB.
    want = sc.max_num_seqs * -(-sc.max_model_len // cc.chunk_size)
    return max(1, min(want, int(2 * 2**30 // block_bytes)))


class LLMEngine(EngineCore):
    """A model on one device with its paged KV cache and scheduler."""

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        mc, cc = config.model, config.cache
        self.device = resolve_device(mc.device)
        torch.manual_seed(mc.seed)
        hf_config, path = resolve_config(mc.model)
        load_format = mc.load_format
        if path is None and load_format == "auto":
            load_format = "dummy"  # a preset shape has no checkpoint
        policy = get_policy(cc.cache_policy)
        self.runner: ModelRunner | TPExecutor
        if mc.tensor_parallel_size > 1:
            self._init_tensor_parallel(hf_config, path, load_format, policy.uses_cpu_tier)
        else:
            self.model, self.hf_config = load_model(
                path or hf_config, dtype=resolve_dtype(mc.dtype, self.device, hf_config),
                device=self.device, load_format=load_format, seed=mc.seed,
            )
            self.dtype = next(self.model.parameters()).dtype
            m = self.model
            block_bytes = kv_bytes_per_block(m.num_layers, cc.chunk_size, m.num_kv_heads,
                                             m.head_dim, self.dtype)
            num_blocks = self._num_blocks(block_bytes)
            self.kv_caches = allocate_kv_caches(m.num_layers, num_blocks, cc.chunk_size,
                                                m.num_kv_heads, m.head_dim, self.dtype,
                                                self.device)
            self.block_bytes = block_bytes
            num_cpu_blocks = self._num_cpu_blocks(block_bytes) if policy.uses_cpu_tier else 0
            log.info("KV cache: %d GPU-tier blocks (%.2f GiB) on %s, %d CPU-tier blocks "
                     "(%.2f GiB), chunk %d, policy %s", num_blocks,
                     num_blocks * block_bytes / 2**30, self.device, num_cpu_blocks,
                     num_cpu_blocks * block_bytes / 2**30, cc.chunk_size, policy.name)
            self.runner = ModelRunner(self.model, self.kv_caches, cc.chunk_size, num_cpu_blocks)
            self.runner.capture_graphs(config.decode_graph_shape(self.device.type),
                                       config.mixed_graph_shape(self.device.type))
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
        self._init_core(config.scheduler, self._make_cache(policy.name), clock, eos_ids,
                        int(self.hf_config.vocab_size))

    def _make_cache(self, cache_policy: str) -> TieredKVCache:
        cc = self.config.cache
        policy = get_policy(cache_policy)
        cpu = self.runner.swapper.num_cpu_blocks if policy.uses_cpu_tier else 0
        return TieredKVCache(self.runner.swapper.num_gpu_blocks, cpu, cc.chunk_size, policy,
                             self.cost_model.chunk_cost, cc.swap_out_threshold,
                             cc.decode_reserve, swap_chunk_s=self.swap_chunk_s)

    def reset(self, cache_policy: str | None = None) -> None:
        """Forget every request and conversation and start with empty tiers, optionally under
        another cache policy; the model, the KV tensors and the pinned CPU tier are kept (the
        benchmark runs many points on one engine). The CPU tier keeps the size it was built
        with (none if the engine was built with a policy that has no CPU tier). Copies still in
        flight finish first: the new cache may hand their blocks out at once."""
        finish = getattr(self.runner.swapper, "finish_step", None)  # TP ranks hold no copies
        if finish is not None:
            finish()
        self._install(self._make_cache(cache_policy or self.cache.policy.name))

    def _execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute(sched)

    def cache_stats(self) -> dict[str, int]:
        """Totals since start: token sources, swaps, drops, suspensions, blocks in use."""
        return self._core_stats(self.runner.swapper.bytes_in, self.runner.swapper.bytes_out)

    def _init_tensor_parallel(self, hf_config: object, path: str | None, load_format: str,
                              uses_cpu_tier: bool) -> None:
        """``tensor_parallel_size > 1``: worker processes hold the model shards and each rank's
        slice of both KV tiers (``pensieve.parallel``); this process keeps the scheduler and a
        weightless (meta-device) model for its shapes."""
        from pensieve.parallel.executor import TPExecutor
        from pensieve.parallel.tp import local_kv_heads

        self.hf_config = hf_config
        self.dtype = resolve_dtype(self.config.model.dtype, self.device, hf_config)
        self.runner = TPExecutor(self.config, path or hf_config, hf_config, self.dtype,
                                 load_format, self.device, uses_cpu_tier)
        self.model = self.runner.model
        self.kv_caches = []
        m = self.model
        world = self.config.model.tensor_parallel_size
        self.block_bytes = kv_bytes_per_block(m.num_layers, self.config.cache.chunk_size,
                                              local_kv_heads(m.num_kv_heads, world), m.head_dim,
                                              self.dtype)
        """One rank's bytes per chunk: the ranks copy their slices at once, each on its link."""

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (idempotent; a no-op otherwise)."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    def _num_cpu_blocks(self, block_bytes: int) -> int:
        return size_cpu_tier(self.config, self.device, block_bytes)

    def _num_blocks(self, block_bytes: int) -> int:
        return size_gpu_tier(self.config, self.device, self.hf_config, self.dtype, block_bytes)
