"""The KV layout (``engine/kv_layout.py``) and the tier sizes over it.

Tier sizes pinned: the GPU- and CPU-tier block counts and the bytes per chunk for a few
models, KV dtypes, devices and tensor-parallel sizes. The numbers were computed by the sizing
code as it was before the KV layout had one home (three copies of the bytes per chunk: the
local executor, the TP driver, the TP rank; commit 1f9b8b4 ran this file on that code), so a
change of the layout code that moves any of them is a change of behaviour."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pensieve.config import CacheConfig, EngineConfig, ModelConfig
from pensieve.core.scheduling_config import SchedulerConfig
from pensieve.engine.kv_layout import KVLayout
from pensieve.engine.tiers import GIB, SIM, DeviceMemory, activation_bytes, tier_sizes
from pensieve.models.loader import build_model, resolve_config

H100 = (70 * GIB, 80 * GIB)
"""(free, total) bytes of an 80 GB GPU after the weights."""


def _sizes(model: str, world: int, device: str, memory: tuple[int, int] | None,
           **cache: Any) -> tuple[int, int, int]:
    """(GPU-tier blocks, CPU-tier blocks, bytes per chunk) of one rank, as the executors size
    them: the model's shape from a meta-device build, its dtype bf16 on CUDA and fp32 on the
    CPU, the activation estimate over the full (unsharded) model."""
    hf, _ = resolve_config(model)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    m: Any = build_model(hf, dtype, "meta")
    config = EngineConfig(model=ModelConfig(model=model, tensor_parallel_size=world),
                          cache=CacheConfig(**cache),
                          scheduler=SchedulerConfig(max_num_seqs=64, max_model_len=8192))
    layout = KVLayout.of(m, config.cache, dtype, world)
    mem = None
    if memory is not None:
        elem = torch.empty((), dtype=dtype).element_size()
        mem = DeviceMemory(*memory, activation_bytes(config, hf.hidden_size,
                                                     hf.intermediate_size, hf.vocab_size,
                                                     elem, layout.fp8))
    t = tier_sizes(config, layout.block_bytes, device, mem, ranks=world)
    return t.num_gpu_blocks, t.num_cpu_blocks, t.block_bytes


CASES = [
    # the default model (30 layers, 3 KV heads of 64), on a GPU and on the CPU
    (("smollm2-135m-instruct", 1, "cuda", H100), {}, (86869, 46603, 737280)),
    (("smollm2-135m-instruct", 1, "cuda", H100), {"kv_cache_dtype": "fp8_e4m3"},
     (170825, 93206, 368640)),
    (("smollm2-135m-instruct", 1, "cpu", None), {}, (1456, 728, 1474560)),
    (("smollm2-135m-instruct", 1, "cpu", None), {"kv_cache_dtype": "fp8"}, (5825, 2912, 368640)),
    (("smollm2-135m-instruct", 1, "cuda", H100), {"gpu_kv_gb": 3.5, "cpu_kv_gb": 10.0},
     (5097, 14563, 737280)),
    (("smollm2-135m-instruct", 3, "cuda", H100), {}, (260608, 46603, 245760)),
    # llama3.1-8b: 32 layers, 8 KV heads of 128
    (("llama3.1-8b", 1, "cuda", H100), {}, (14721, 8192, 4194304)),
    (("llama3.1-8b", 1, "cuda", H100), {"kv_cache_dtype": "fp8_e4m3"}, (28930, 16384, 2097152)),
    (("llama3.1-8b", 2, "cuda", H100), {}, (29442, 8192, 2097152)),
    (("llama3.1-8b", 4, "cuda", H100), {"kv_cache_dtype": "fp8_e4m3"}, (115720, 16384, 524288)),
    (("llama3.1-8b", 2, "cuda", H100), {"num_gpu_blocks": 100, "num_cpu_blocks": 7},
     (100, 7, 2097152)),
    (("llama3.1-8b", 1, "cuda", H100), {"cache_policy": "gpu-only"}, (14721, 0, 4194304)),
    # fewer KV heads than ranks: one replicated head per rank
    (("llama-tiny", 4, "cpu", None), {"cpu_kv_gb": 0.25}, (16384, 8192, 8192)),
]


@pytest.mark.parametrize(("where", "cache", "want"), CASES)
def test_tier_sizes_are_pinned(where: tuple[Any, ...], cache: dict[str, Any],
                               want: tuple[int, int, int]) -> None:
    assert _sizes(*where, **cache) == want


def _sim_sizes(block_bytes: int | None, **cache: Any) -> tuple[int, int, int]:
    """(GPU-tier blocks, CPU-tier blocks, bytes per chunk) as the simulator sizes them."""
    t = tier_sizes(EngineConfig(cache=CacheConfig(**cache)), block_bytes, SIM)
    return t.num_gpu_blocks, t.num_cpu_blocks, t.block_bytes


SIM_CASES = [
    ((737280,), {"gpu_kv_gb": 3.5, "cpu_kv_gb": 10.0}, (5097, 14563, 737280)),
    ((368640,), {"gpu_kv_gb": 3.5, "cpu_kv_gb": 10.0, "cache_policy": "gpu-only"},
     (10194, 29127, 368640)),
    ((None,), {"num_gpu_blocks": 9, "num_cpu_blocks": 0}, (9, 0, 0)),
]


@pytest.mark.parametrize(("where", "cache", "want"), SIM_CASES)
def test_simulated_tier_sizes_are_pinned(where: tuple[Any, ...], cache: dict[str, Any],
                                         want: tuple[int, int, int]) -> None:
    assert _sim_sizes(*where, **cache) == want


def test_layout_allocates_its_bytes_per_chunk_and_resolves_each_dtype() -> None:
    hf, _ = resolve_config("llama-tiny")  # 2 layers, 2 KV heads of 16
    m: Any = build_model(hf, torch.float32, "meta")
    for name, dtype in (("auto", torch.float32), ("bf16", torch.bfloat16),
                        ("fp16", torch.float16), ("fp32", torch.float32),
                        ("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn)):
        layout = KVLayout.of(m, CacheConfig(chunk_size=16, kv_cache_dtype=name), torch.float32)
        assert layout.dtype == dtype and layout.fp8 == (dtype == torch.float8_e4m3fn)
        caches = layout.allocate(3, torch.device("cpu"))
        assert len(caches) == layout.num_layers
        assert caches[0].shape == (2, 3, 16, layout.num_kv_heads, layout.head_dim)
        assert sum(c.numel() * c.element_size() for c in caches) == 3 * layout.block_bytes
    # fewer KV heads than ranks: each rank keeps one (replicated)
    assert KVLayout.of(m, CacheConfig(), torch.float32, world=4).num_kv_heads == 1
    assert KVLayout.of(m, CacheConfig(), torch.float32, world=2).num_kv_heads == 1
    assert KVLayout.of(m, CacheConfig(), torch.float32).num_kv_heads == 2
