"""The local executor: one :class:`ModelRunner` in this process; and the steps every model
runner is built with (size, allocate, capture), shared with the tensor-parallel ranks.

A runner is made in three steps, the same for :class:`LocalExecutor` and for each rank of
:mod:`pensieve.parallel.worker` (which shards the model first, is given its
:class:`~pensieve.engine.kv_layout.KVLayout` by the driver, and agrees on the block counts with
the other ranks between the second and the third):

1. the model is loaded (``pensieve.models.loader.load_model``);
2. :func:`device_memory` measures the device and ``engine.tiers.tier_sizes`` turns it, the
   config and the layout's bytes per chunk into blocks per tier;
3. :func:`start_runner`: the KV tensors (:meth:`KVLayout.allocate`), the runner with its CPU
   tier, the CUDA graphs.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from pensieve.config import EngineConfig
from pensieve.core.outputs import RunnerOutput, SchedulerOutput
from pensieve.engine.executor import TierSizes
from pensieve.engine.kv_layout import KVLayout
from pensieve.engine.tiers import DeviceMemory, activation_bytes, tier_sizes
from pensieve.layers.attention import init_kv_scales
from pensieve.runner.model_runner import ModelRunner

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


def device_memory(config: EngineConfig, device: torch.device, hf_config: Any,
                  dtype: torch.dtype, layout: KVLayout) -> DeviceMemory | None:
    """The GPU's free and total memory now and the step's activation estimate for a model of
    ``dtype`` with a KV cache of ``layout`` (None on the CPU). Call it after the weights are
    loaded."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    hidden = int(getattr(hf_config, "hidden_size", 4096))
    inter = int(getattr(hf_config, "intermediate_size", None)
                or getattr(hf_config, "ffn_dim", 4 * hidden))
    elem = torch.empty((), dtype=dtype).element_size()
    return DeviceMemory(free, total, activation_bytes(config, hidden, inter,
                                                      int(hf_config.vocab_size), elem,
                                                      layout.fp8))


def start_runner(config: EngineConfig, model: Any, layout: KVLayout, device: torch.device,
                 num_gpu_blocks: int, num_cpu_blocks: int) -> ModelRunner:
    """Allocate ``model``'s KV tiers as ``layout`` has them, build its runner and capture its
    CUDA graphs."""
    t0 = time.perf_counter()
    kv_caches = layout.allocate(num_gpu_blocks, device)
    if layout.fp8:  # a checkpoint's calibrated scales, else 1
        init_kv_scales(model, device, getattr(model, "checkpoint_kv_scales", None))
    t1 = time.perf_counter()
    runner = ModelRunner(model, layout, kv_caches, num_cpu_blocks,
                         tokenizer=config.model.model)
    t2 = time.perf_counter()
    runner.capture_graphs(config.decode_graph_shape(device.type),
                          config.mixed_graph_shape(device.type))
    log.info("engine start: GPU tier %.1f s, CPU tier and kernels %.1f s, CUDA graphs %.1f s",
             t1 - t0, t2 - t1, time.perf_counter() - t2)
    return runner


class LocalExecutor:
    """A loaded model on one device with its KV tiers, run by a :class:`ModelRunner`."""

    def __init__(self, config: EngineConfig, model: Any, hf_config: Any,
                 device: torch.device) -> None:
        cc = config.cache
        dtype = next(model.parameters()).dtype
        layout = KVLayout.of(model, cc, dtype)
        tiers = tier_sizes(config, layout.block_bytes, device.type,
                           device_memory(config, device, hf_config, dtype, layout))
        num_gpu, num_cpu, block_bytes = (tiers.num_gpu_blocks, tiers.num_cpu_blocks,
                                          tiers.block_bytes)
        log.info("KV cache: %d GPU-tier blocks (%.2f GiB) on %s, %d CPU-tier blocks "
                 "(%.2f GiB), chunk %d, %s, policy %s", num_gpu, num_gpu * block_bytes / 2**30,
                 device, num_cpu, num_cpu * block_bytes / 2**30, cc.chunk_size, layout.dtype,
                 cc.cache_policy)
        self.runner = start_runner(config, model, layout, device, num_gpu, num_cpu)
        self._tiers = tiers

    @property
    def tiers(self) -> TierSizes:
        return self._tiers

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute(sched)

    def stats(self) -> dict[str, int]:
        sw = self.runner.swapper
        return {"swap_in_bytes": sw.bytes_in, "swap_out_bytes": sw.bytes_out}

    def shutdown(self) -> None:
        """Nothing to release (the tensors go with the executor)."""
