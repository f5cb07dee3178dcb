"""``swap_bandwidth_gbps``: validation, resolution per device, the seconds per chunk the engine
computes from it and hands to the cache, and ``pensieve serve --swap-bandwidth-gbps``."""

from __future__ import annotations

import argparse
import inspect
import math

import pytest

from pensieve.config import (
    DEFAULT_DEFER_ADMISSION,
    DEFAULT_SWAP_BANDWIDTH_GBPS,
    CacheConfig,
    EngineConfig,
    swap_chunk_seconds,
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


def test_engine_hands_seconds_per_chunk_to_the_cache() -> None:
    """The engine computes ``block_bytes / rate`` and the cache gets it as ``swap_chunk_s``,
    also after ``reset``; on the CPU "auto" is off (always swap in)."""
    from pensieve.engine.llm import build_engine_config
    from pensieve.engine.llm_engine import LLMEngine

    cfg = build_engine_config(model="llama-tiny", dtype="float32", device="cpu",
                              num_gpu_blocks=16, num_cpu_blocks=16)
    fast = EngineConfig(cfg.model, CacheConfig(num_gpu_blocks=16, num_cpu_blocks=16,
                                               swap_bandwidth_gbps=2.5), cfg.scheduler)
    eng = LLMEngine(fast)
    m = eng.model
    assert eng.block_bytes == 2 * m.num_layers * 32 * m.num_kv_heads * m.head_dim * 4
    assert eng.swap_chunk_s == pytest.approx(eng.block_bytes / 2.5e9)
    assert eng.cache.swap_chunk_s == eng.swap_chunk_s
    eng.reset("lru")  # a new cache, same figure
    assert eng.cache.swap_chunk_s == eng.swap_chunk_s and eng.cache.policy.name == "lru"

    auto = LLMEngine(cfg)  # CPU device, "auto": off
    assert auto.swap_chunk_s is None and auto.cache.swap_chunk_s is None
    assert inspect.signature(TieredKVCache).parameters["swap_chunk_s"].default is None  # its own


def test_serve_flag() -> None:
    from pensieve.options import swap_bandwidth_arg
    from pensieve.server.main import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert p.parse_args([]).swap_bandwidth_gbps is None  # the config's default
    assert CacheConfig().swap_bandwidth_gbps == "auto"
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


def test_decode_reserve_flag() -> None:
    """``pensieve serve --decode-reserve``: a fraction in [0, 1) reaching the cache; anything
    else is refused by the parser, before a model loads."""
    from pensieve.engine.llm import build_engine_config
    from pensieve.server.main import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert p.parse_args([]).decode_reserve is None  # the config's default
    assert p.parse_args(["--decode-reserve", "0.04"]).decode_reserve == 0.04
    assert p.parse_args(["--decode-reserve", "0"]).decode_reserve == 0.0
    for bad in ("1", "-0.1", "nan", "lots"):
        with pytest.raises(SystemExit):
            p.parse_args(["--decode-reserve", bad])
    cfg = build_engine_config(model="demo-random", device="cpu", decode_reserve=0.04)
    assert cfg.cache.decode_reserve == 0.04


def test_defer_admission_flag() -> None:
    """``pensieve serve --defer-admission``: a whole number of steps reaching the cache
    (``DEFAULT_DEFER_ADMISSION``, 3, by default); anything else refused by the parser, and by
    the config when given directly."""
    from pensieve.engine.llm import LLM, build_engine_config
    from pensieve.server.main import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert p.parse_args([]).defer_admission is None  # the config's default
    assert p.parse_args(["--defer-admission", "2"]).defer_admission == 2
    for bad in ("-1", "1.5", "many", ""):
        with pytest.raises(SystemExit):
            p.parse_args(["--defer-admission", bad])
    cfg = build_engine_config(model="demo-random", device="cpu", defer_admission=2)
    assert cfg.cache.defer_admission == 2
    assert CacheConfig().defer_admission == DEFAULT_DEFER_ADMISSION == 3
    for bad_value in (-1, 1.5, True):
        with pytest.raises(ValueError, match="defer_admission"):
            CacheConfig(defer_admission=bad_value)  # type: ignore[arg-type]
    llm = LLM(model="demo-random", device="cpu", num_gpu_blocks=16, num_cpu_blocks=4,
              defer_admission=3)
    assert llm.engine.scheduler.cache.defer_admission == 3


def test_switch_interval_flag() -> None:
    """``pensieve serve --switch-interval-ms``: 0.5 ms unless given; a positive number of ms,
    anything else refused by the parser."""
    from pensieve.server.main import DEFAULT_SWITCH_INTERVAL_MS, add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert p.parse_args([]).switch_interval_ms == DEFAULT_SWITCH_INTERVAL_MS == 0.5
    assert p.parse_args(["--switch-interval-ms", "2"]).switch_interval_ms == 2.0
    for bad in ("0", "-1", "inf", "nan", "soon"):
        with pytest.raises(SystemExit):
            p.parse_args(["--switch-interval-ms", bad])


def test_shutdown_timeout_flag() -> None:
    """``pensieve serve --shutdown-timeout``: 30 s unless given; a finite number of seconds
    >= 0 (0: end the turns at once), anything else refused by the parser."""
    from pensieve.server.main import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert p.parse_args([]).shutdown_timeout == 30.0
    assert p.parse_args(["--shutdown-timeout", "0"]).shutdown_timeout == 0.0
    assert p.parse_args(["--shutdown-timeout", "2.5"]).shutdown_timeout == 2.5
    for bad in ("-1", "inf", "nan", "soon"):
        with pytest.raises(SystemExit):
            p.parse_args(["--shutdown-timeout", bad])



def test_defer_admission_is_on_the_record() -> None:
    """The setting a server ran with is in its ``/metrics`` (``pensieve_defer_admission_steps``),
    so that a run's saved metrics say it (the simulator's validation reads it from there)."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from pensieve.engine.llm import LLM
    from pensieve.server.engine_loop import Snapshot
    from pensieve.server.engine_metrics import _EngineCollector

    llm = LLM(model="demo-random", device="cpu", num_gpu_blocks=16, num_cpu_blocks=4,
              defer_admission=2)
    stats = llm.cache_stats()
    assert stats["defer_admission"] == 2
    reg = CollectorRegistry()
    reg.register(_EngineCollector(SimpleNamespace(snapshot=Snapshot(stats=stats))))
    assert "pensieve_defer_admission_steps 2.0" in generate_latest(reg).decode()
