"""Tier sizes: config, bytes per chunk and free device memory in, blocks per tier out; the
cache over them. One pure function, :func:`tier_sizes`, for the three executors (local, each
tensor-parallel rank, simulated). No torch: the callers measure the device
(``torch.cuda.mem_get_info``) and take the bytes per chunk from their
:class:`~pensieve.engine.kv_layout.KVLayout` (the simulator is given them).

- GPU tier: ``num_gpu_blocks``, else ``gpu_kv_gb``, else on a GPU what is free after the
  weights, minus ``1 - gpu_memory_utilization`` of the device and an activation estimate; on
  the CPU enough for every running request to reach ``max_model_len``, at most
  ``CPU_RUN_GPU_KV_GB`` (2 GiB).
- CPU tier: ``num_cpu_blocks``, else ``cpu_kv_gb``, else ``DEFAULT_CPU_KV_GB`` (32 GiB beside a
  GPU, 1 GiB on a CPU run); none when the cache policy keeps no CPU tier.
- Under tensor parallelism the block bytes are one rank's slice; ``gpu_kv_gb`` applies to each
  rank's device and ``cpu_kv_gb`` is the host's total (:func:`cpu_tier_blocks`'s ``ranks``).
- The simulator (``device_type`` :data:`SIM`): exact counts, or GiB over the block bytes; no
  device's defaults (memory left after the weights has to be given as ``num_gpu_blocks``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pensieve.config import (
    CPU_RUN_GPU_KV_GB,
    DEFAULT_CPU_KV_GB,
    FP8_SCRATCH_BYTES,
    CacheConfig,
    EngineConfig,
)
from pensieve.core.cost_model import CostModel
from pensieve.core.disk_index import DiskIndex
from pensieve.core.eviction import EvictionPolicy
from pensieve.core.tiered_cache import TieredKVCache, cdiv
from pensieve.engine.executor import TierSizes

GIB = 2**30


def gib_blocks(gib: float, block_bytes: int) -> int:
    """Whole blocks of ``block_bytes`` in ``gib`` GiB."""
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
    return int(gib * GIB // block_bytes)


@dataclass(frozen=True)
class DeviceMemory:
    """A GPU's memory after the weights are loaded (bytes)."""

    free_bytes: int
    total_bytes: int
    activation_bytes: int
    """What a step needs beside weights and KV (:func:`activation_bytes`)."""


def activation_bytes(config: EngineConfig, hidden: int, intermediate: int, vocab: int,
                     elem_bytes: int, fp8_kv: bool) -> int:
    """Estimated peak activations of one step of ``max_num_batched_tokens`` tokens, logits of
    ``max_num_seqs`` rows (three float32 copies) and 1 GiB of slack; doubled when mixed-step
    CUDA graphs keep their own pool beside the eager allocator's; plus ``FP8_SCRATCH_BYTES``
    with an FP8 KV cache (``fp8_kv``, ``KVLayout.fp8``: eager prefill steps dequantize into a
    scratch)."""
    sc = config.scheduler
    act = sc.max_num_batched_tokens * (8 * hidden + 3 * intermediate) * elem_bytes
    act += sc.max_num_seqs * vocab * 4 * 3 + GIB
    if config.mixed_graph_shape("cuda") is not None:
        act *= 2
    if fp8_kv:
        act += FP8_SCRATCH_BYTES
    return act


def gpu_tier_blocks(config: EngineConfig, block_bytes: int, memory: DeviceMemory | None) -> int:
    """GPU-tier blocks (module docstring); ``memory`` None: the device is the CPU."""
    cc, sc = config.cache, config.scheduler
    if cc.num_gpu_blocks is not None:
        return cc.num_gpu_blocks
    if cc.gpu_kv_gb is not None:
        return max(1, gib_blocks(cc.gpu_kv_gb, block_bytes))
    if memory is not None:
        budget = (memory.free_bytes - (1 - cc.gpu_memory_utilization) * memory.total_bytes
                  - memory.activation_bytes)
        return max(1, int(budget // block_bytes))
    want = sc.max_num_seqs * cdiv(sc.max_model_len, cc.chunk_size)
    return max(1, min(want, gib_blocks(CPU_RUN_GPU_KV_GB, block_bytes)))


def cpu_tier_blocks(cache: CacheConfig, block_bytes: int, device_type: str,
                    ranks: int = 1) -> int:
    """CPU-tier blocks per rank (module docstring): ``cpu_kv_gb`` is shared by ``ranks``."""
    if not cache.policy.uses_cpu_tier:
        return 0
    if cache.num_cpu_blocks is not None:
        return cache.num_cpu_blocks
    gib = cache.cpu_kv_gb if cache.cpu_kv_gb is not None else DEFAULT_CPU_KV_GB.get(
        device_type, DEFAULT_CPU_KV_GB["cpu"])
    return gib_blocks(gib, block_bytes * ranks)


SIM = "sim"
"""``device_type`` of the simulator: no device (:func:`tier_sizes`)."""


def tier_sizes(config: EngineConfig, block_bytes: int | None, device_type: str,
               memory: DeviceMemory | None = None, ranks: int = 1) -> TierSizes:
    """Blocks per tier of ``block_bytes`` (one rank's bytes per chunk) on a ``device_type``
    (``cuda``, ``cpu``, or :data:`SIM`) with ``memory`` free after the weights (None: on the
    CPU, or not measured), for one of ``ranks`` tensor-parallel ranks (module docstring).
    Every executor sizes its tiers here and nowhere else."""
    if device_type == SIM:
        return _sim_tiers(config.cache, block_bytes)
    if not block_bytes:
        raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
    return TierSizes(gpu_tier_blocks(config, block_bytes, memory),
                     cpu_tier_blocks(config.cache, block_bytes, device_type, ranks), block_bytes)


def _sim_tiers(cache: CacheConfig, block_bytes: int | None) -> TierSizes:
    """The simulator's tiers: exact counts, or GiB sizes over ``block_bytes``."""
    counts = []
    for tier, n, gib in (("gpu", cache.num_gpu_blocks, cache.gpu_kv_gb),
                         ("cpu", cache.num_cpu_blocks, cache.cpu_kv_gb)):
        if n is None:
            if gib is None or not block_bytes:
                raise ValueError(f"the simulator needs num_{tier}_blocks, or {tier}_kv_gb and "
                                 "block_bytes")
            n = gib_blocks(gib, block_bytes)
        counts.append(n)
    return TierSizes(max(1, counts[0]), counts[1], block_bytes or 0)


def check_fits(max_model_len: int, chunk_size: int, tiers: TierSizes) -> str | None:
    """Why one running request of ``max_model_len`` tokens could not hold its KV in the GPU
    tier (attention reads a running request's whole context from it), or None if it can."""
    need = cdiv(max_model_len, chunk_size)
    if need > tiers.num_gpu_blocks:
        gib = need * tiers.block_bytes / GIB
        return (
            f"max_model_len={max_model_len} needs {need} KV chunks ({gib:.2f} GiB) for one "
            f"request, but the GPU tier holds {tiers.num_gpu_blocks} "
            f"({tiers.num_gpu_blocks * tiers.block_bytes / GIB:.2f} GiB): lower "
            "--max-model-len, give the tier more memory (--gpu-kv-gb, "
            "--gpu-memory-utilization) or halve the bytes per token (--kv-cache-dtype "
            "fp8_e4m3)")
    return None


def build_cache(tiers: TierSizes, chunk_cost: CostModel | Callable[[int], float],
                config: CacheConfig, *, policy: EvictionPolicy | None = None,
                swap_chunk_s: float | None = None,
                disk: DiskIndex | None = None) -> TieredKVCache:
    """The tiered cache over ``tiers`` built from ``config`` whole (no CPU tier if its policy
    keeps none); ``policy``: another than ``config.policy`` (an engine reset).
    ``chunk_cost``: a :class:`CostModel` for this chunk size, or any function of the context
    length. ``swap_chunk_s``: the measured seconds per chunk copy (``swap_chunk_seconds``).
    ``disk``: the disk tier's index below the CPU tier (None: none)."""
    if isinstance(chunk_cost, CostModel):
        if chunk_cost.chunk_size != config.chunk_size:
            raise ValueError(f"cost model is for chunk_size {chunk_cost.chunk_size}, the "
                             f"cache uses {config.chunk_size}")
        chunk_cost = chunk_cost.chunk_cost
    policy = config.policy if policy is None else policy
    cpu = tiers.num_cpu_blocks if policy.uses_cpu_tier else 0
    return TieredKVCache(tiers.num_gpu_blocks, cpu, chunk_cost, config, policy=policy,
                         swap_chunk_s=swap_chunk_s, disk=disk)
