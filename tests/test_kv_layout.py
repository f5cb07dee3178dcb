"""The KV layout (``engine/kv_layout.py``) and the tier sizes over it.

Tier sizes pinned: the GPU- and CPU-tier block counts and the bytes per chunk for a few
models, KV dtypes, devices and tensor-parallel sizes. The numbers were computed by the sizing
code as it was before the KV layout had one home (three copies of the bytes per chunk: the
local executor, the TP driver, the TP rank; commit 1f9b8b4 ran this file on that code), so a
change of the layout code that moves any of them is a change of behaviour.

Past sizing: the swapper and the disk tier take their bytes per chunk from the layout; a tiny
model's engine shows that the bytes they count, copy and write per chunk are the layout's, for
float32, bf16 and FP8 caches and both CPU tier layouts."""

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


KV_DTYPES = [("auto", torch.float32), ("bf16", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn)]
"""``kv_cache_dtype`` of a float32 model and the KV dtype it resolves to."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _chunk(caches: list[torch.Tensor], block: int) -> bytes:
    """Block ``block``'s K and V over all layers, ``[L, 2, C, Hkv, D]``, as raw bytes."""
    kv = torch.stack([c[:, block] for c in caches]).contiguous()
    return kv.view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(("kv_dtype", "dtype"), KV_DTYPES, ids=[k for k, _ in KV_DTYPES])
def test_swapper_and_disk_tier_move_the_layouts_bytes_per_chunk(
        tiny_llama, tmp_path, kv_dtype: str, dtype: torch.dtype) -> None:  # noqa: ANN001
    """An engine over a tiny random Llama resolves one layout; its tensors hold, the swapper
    counts and copies, and the disk tier writes exactly ``layout.block_bytes`` per chunk, for
    either CPU tier layout (``dma``: layer-major, ``staged``: chunk-major). An FP8 cache's
    scales stay with the attention layers: no bytes of a chunk, none in its file."""
    import hashlib

    from pensieve import LLM
    from pensieve.core.disk_index import DiskEntry, spilled_key
    from pensieve.core.outputs import SwapPlan
    from pensieve.engine import disk_files
    from pensieve.engine.disk_tier import DiskTier
    from pensieve.layers.attention import PagedAttention
    from pensieve.runner.swapper import KVSwapper

    path, _ = tiny_llama
    llm = LLM(model=path, dtype="float32", device="cpu", chunk_size=16, num_gpu_blocks=8,
              num_cpu_blocks=4, kv_cache_dtype=kv_dtype, disk_kv_gb=0.01,
              disk_kv_path=str(tmp_path / "engine"))
    eng = llm.engine
    layout = eng.runner.layout
    # the tiny Llama: 2 layers, 2 KV heads of 64 / 4 = 16; chunks of 16 tokens
    assert layout == KVLayout(2, 2, 16, 16, dtype)
    one = 2 * 2 * 16 * 2 * 16 * dtype.itemsize
    assert layout.block_bytes == one and layout.layer_bytes * 2 == one
    # everything past sizing reads the one layout
    assert eng.block_bytes == eng.executor.tiers.block_bytes == one
    assert eng.runner.swapper.layout is layout and eng.runner.swapper.chunk_bytes == one
    assert eng.disk_tier is not None and eng.disk_tier.block_bytes == one
    assert sum(_nbytes(c[:, 0]) for c in eng.kv_caches) == one
    assert sum(_nbytes(c[:, 0]) for c in eng.runner.swapper.cpu_caches) == one
    scales = [m.kv_scale for m in eng.model.modules() if isinstance(m, PagedAttention)]
    if layout.fp8:
        assert [tuple(s.shape) for s in scales] == [(2, 2)] * 2  # per layer, K / V per head
    else:
        assert scales == [None, None]
    eng.shutdown()

    g = torch.Generator().manual_seed(0)
    for method, chunk_major in (("dma", False), ("staged", True)):
        gpu = layout.allocate(4, torch.device("cpu"))
        for c in gpu:
            c.copy_(torch.randn(c.shape, generator=g).to(dtype))
        sw = KVSwapper(layout, gpu, 3, method)
        assert sw.host_layout == ("chunk-major" if chunk_major else "layer-major")
        assert sum(_nbytes(c[:, 2]) for c in sw.cpu_caches) == one
        sw.start_step(SwapPlan(swap_out=[(1, 2)]))
        sw.finish_step()
        assert sw.bytes_out == one and _chunk(sw.cpu_caches, 2) == _chunk(gpu, 1)
        assert len(_chunk(gpu, 1)) == one
        ready = sw.start_step(SwapPlan(swap_in=[(2, 3)]))
        assert ready is not None
        for layer in range(layout.num_layers):
            ready(layer)
        sw.finish_step()
        assert sw.bytes_in == one and _chunk(gpu, 3) == _chunk(gpu, 1)

        where = str(tmp_path / method)
        tier = DiskTier(where, 4, layout, "fp", sw.cpu_caches, gpu, read_threads=1)
        assert (tier._cpu_blocks is not None) == chunk_major
        h = hashlib.blake2b(method.encode(), digest_size=16).hexdigest()
        entry = DiskEntry("", 0, layout.chunk_size, h, spilled_key((0.0, 0.0, "", 0.0)))
        assert tier.index.store("a", entry, 2, False)
        tier.apply(tier.index.take_plan())
        tier.wait_writes()
        assert tier.bytes_written == one
        with open(tier.local.file(entry.name), "rb") as f:  # type: ignore[union-attr]
            data = f.read()
        payload = disk_files.decode(bytearray(data), "fp", "", 0, layout.chunk_size, h, one)
        assert payload is not None and payload.nbytes == one  # the header's nbytes too
        assert bytes(payload) == _chunk(sw.cpu_caches, 2)  # K and V only: no scales
        tier.close(None)
        reader = DiskTier(where, 4, layout, "fp", sw.cpu_caches, gpu, read_threads=1)
        assert reader.found == 1  # a file of this layout's bytes per chunk
        reader.close(None)
