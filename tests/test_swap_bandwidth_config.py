"""``swap_bandwidth_gbps``: validation, resolution per device, the seconds per chunk the engine
computes from it and hands to the cache, and ``pensieve serve --swap-bandwidth-gbps``."""

from __future__ import annotations

import argparse
import inspect
import math

import pytest

from pensieve.config import (
    DEFAULT_SWAP_BANDWIDTH_GBPS,
    CacheConfig,
    EngineConfig,
    swap_chunk_seconds,
    tiered_cache_swap_kwargs,
)
from pensieve.core.tiered_cache import TieredKVCache


def test_default_is_auto_45_on_cuda_off_on_cpu() -> None:
    cc = CacheConfig()
    assert cc.swap_bandwidth_gbps == "auto"
    assert DEFAULT_SWAP_BANDWIDTH_GBPS == 45.0
    assert cc.swap_bandwidth("cuda") == 45.0
    assert cc.swap_bandwidth("cpu") is None
    assert CacheConfig(swap_bandwidth_gbps="off").swap_bandwidth("cuda") is None
    assert CacheConfig(swap_bandwidth_gbps=None).swap_bandwidth("cuda") is None
    given = CacheConfig(swap_bandwidth_gbps=12)
    assert given.swap_bandwidth_gbps == 12.0 and isinstance(given.swap_bandwidth_gbps, float)
    assert given.swap_bandwidth("cpu") == given.swap_bandwidth("cuda") == 12.0


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, "fast", "AUTO", True, [45]])
def test_validation(bad: object) -> None:
    with pytest.raises(ValueError, match="swap_bandwidth_gbps"):
        CacheConfig(swap_bandwidth_gbps=bad)  # type: ignore[arg-type]


def test_swap_chunk_seconds() -> None:
    # Llama 2-13B GQA chunk: 32 tokens x 2 (K, V) x 40 layers x 10 heads x 128 x 2 bytes
    block = 32 * 2 * 40 * 10 * 128 * 2
    assert swap_chunk_seconds(block, 45.0) == pytest.approx(block / 45e9)
    assert swap_chunk_seconds(block, None) is None
    with pytest.raises(ValueError):
        swap_chunk_seconds(0, 45.0)
    with pytest.raises(ValueError):
        swap_chunk_seconds(block, 0.0)


def test_cache_kwargs_follow_the_cache_signature() -> None:
    takes = "swap_chunk_s" in inspect.signature(TieredKVCache).parameters
    assert tiered_cache_swap_kwargs(1e-4) == ({"swap_chunk_s": 1e-4} if takes else {})


def test_engine_hands_seconds_per_chunk_to_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the real cache takes today, the engine computes ``block_bytes / rate`` and
    passes it to a cache that accepts ``swap_chunk_s`` (here a recording subclass)."""
    import pensieve.config as config_mod
    import pensieve.engine.llm_engine as eng_mod
    from pensieve.engine.llm import build_engine_config
    from pensieve.engine.llm_engine import LLMEngine

    seen: list[float | None] = []

    class Recording(TieredKVCache):
        def __init__(self, *args: object, swap_chunk_s: float | None = None,
                     **kw: object) -> None:
            seen.append(swap_chunk_s)
            params = inspect.signature(TieredKVCache).parameters
            if "swap_chunk_s" in params:
                kw["swap_chunk_s"] = swap_chunk_s
            super().__init__(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(eng_mod, "TieredKVCache", Recording)
    monkeypatch.setattr(config_mod, "TieredKVCache", Recording)
    cfg = build_engine_config(model="llama-tiny", dtype="float32", device="cpu",
                              num_gpu_blocks=16, num_cpu_blocks=16)
    fast = EngineConfig(cfg.model, CacheConfig(num_gpu_blocks=16, num_cpu_blocks=16,
                                               swap_bandwidth_gbps=2.5), cfg.scheduler)
    eng = LLMEngine(fast)
    m = eng.model
    assert eng.block_bytes == 2 * m.num_layers * 32 * m.num_kv_heads * m.head_dim * 4
    assert eng.swap_chunk_s == pytest.approx(eng.block_bytes / 2.5e9)
    assert seen == [eng.swap_chunk_s]
    eng.reset("lru")  # a new cache, same figure
    assert seen[-1] == eng.swap_chunk_s and len(seen) == 2

    auto = LLMEngine(cfg)  # CPU device, "auto": off
    assert auto.swap_chunk_s is None and seen[-1] is None


def test_real_cache_receives_it_when_it_takes_it() -> None:
    if "swap_chunk_s" not in inspect.signature(TieredKVCache).parameters:
        pytest.skip("TieredKVCache has no swap_chunk_s parameter yet")
    from pensieve.engine.llm import LLM

    llm = LLM(model="llama-tiny", dtype="float32", device="cpu", num_gpu_blocks=16,
              num_cpu_blocks=16)
    assert llm.engine.swap_chunk_s is None
    eng = llm.engine
    cfg = EngineConfig(eng.config.model, CacheConfig(num_gpu_blocks=16, num_cpu_blocks=16,
                                                     swap_bandwidth_gbps=10.0),
                       eng.config.scheduler)
    from pensieve.engine.llm_engine import LLMEngine

    e2 = LLMEngine(cfg)
    assert e2.swap_chunk_s == pytest.approx(e2.block_bytes / 10e9)
    assert e2.cache.swap_chunk_s == e2.swap_chunk_s
    e2.reset("pensieve")
    assert e2.cache.swap_chunk_s == e2.swap_chunk_s


def test_serve_flag() -> None:
    from pensieve.server.main import add_serve_args, swap_bandwidth_arg

    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert p.parse_args([]).swap_bandwidth_gbps == "auto"
    assert p.parse_args(["--swap-bandwidth-gbps", "22.5"]).swap_bandwidth_gbps == 22.5
    assert p.parse_args(["--swap-bandwidth-gbps", "off"]).swap_bandwidth_gbps == "off"
    assert swap_bandwidth_arg("none") == "off" and swap_bandwidth_arg("AUTO") == "auto"
    for bad in ("0", "-3", "inf", "nan", "fast"):
        with pytest.raises(argparse.ArgumentTypeError):
            swap_bandwidth_arg(bad)
    with pytest.raises(SystemExit):
        p.parse_args(["--swap-bandwidth-gbps", "fast"])
    # every accepted value is a valid config value
    for v in ("auto", "off", "3"):
        CacheConfig(swap_bandwidth_gbps=swap_bandwidth_arg(v))
