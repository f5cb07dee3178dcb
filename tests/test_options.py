"""The engine's options, generated from the config dataclasses (pensieve.options): one flag per
field on ``serve`` and ``generate``, ``--config FILE`` under the flags, and the cache policy
resolved once into the object the cache is built with."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from pathlib import Path

import pytest

from pensieve.cli import build_parser, main
from pensieve.config import DEFAULT_MODEL, CacheConfig, ModelConfig, owners
from pensieve.core.eviction import POLICIES, EvictionPolicy
from pensieve.core.scheduling_config import SchedulerConfig
from pensieve.core.tiered_cache import TieredKVCache
from pensieve.engine.executor import TierSizes
from pensieve.engine.llm import build_engine_config
from pensieve.engine.tiers import build_cache, cpu_tier_blocks
from pensieve.options import engine_options, field_docs, load_config_file
from pensieve.server.main import SERVER_ENGINE_OPTIONS, add_serve_args


def _sub(cmd: str) -> argparse.ArgumentParser:
    p = build_parser()
    action = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    sub = action.choices[cmd]
    assert isinstance(sub, argparse.ArgumentParser)
    return sub


def _flags(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in p._actions}


@pytest.mark.parametrize("cmd", ["serve", "generate"])
def test_every_config_field_is_a_flag(cmd: str) -> None:
    flags = _flags(_sub(cmd))
    init_fields = [f.name for cls in (ModelConfig, CacheConfig, SchedulerConfig)
                   for f in fields(cls) if f.init]
    assert set(owners()) == set(init_fields) and "policy" not in owners()
    own = SERVER_ENGINE_OPTIONS if cmd == "serve" else ()
    for name in init_fields:
        if name == "model":
            assert flags[name].option_strings == []  # the positional argument
        elif name in own:
            assert "--tenant-kv-share" in flags[name].option_strings  # the server's own
            assert flags[name].default == "auto"
        else:
            assert f"--{name.replace('_', '-')}" in flags[name].option_strings, name
            assert flags[name].default is None, name  # not given: the file's or the config's
    # the help is the field's docstring, with the dataclass default
    assert "Tokens per KV block" in flags["chunk_size"].help
    assert "(default: 32)" in flags["chunk_size"].help
    assert field_docs(SchedulerConfig)["max_num_seqs"].startswith("Most requests running")
    # the older names and aliases still parse
    p = _sub(cmd)
    a = p.parse_args(["-tp", "2", "--no-mixed-graphs", "--enforce-eager", "--gpu-kv-gb", "1.5",
                      "--max-num-seqs", "7", "--cache-policy", "lru"])
    assert (a.tensor_parallel_size, a.cuda_graph_mixed, a.enforce_eager) == (2, False, True)
    assert (a.gpu_kv_gb, a.max_num_seqs, a.cache_policy) == (1.5, 7, "lru")


def test_policy_choices_come_from_the_registry() -> None:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert _flags(p)["cache_policy"].choices == list(POLICIES)
    with pytest.raises(SystemExit):
        p.parse_args(["--cache-policy", "fifo"])


def test_config_file_under_the_flags(tmp_path: Path) -> None:
    f = tmp_path / "engine.json"
    f.write_text(json.dumps({"model": "demo-random", "device": "cpu",
                             "cache": {"gpu_kv_gb": 0.25, "cache-policy": "prefix-lru",
                                       "swap_bandwidth_gbps": "off", "decode_reserve": 0.05},
                             "scheduler": {"max_num_seqs": 9, "batching": "separate"}}))
    p = _sub("generate")
    cfg = build_engine_config(**engine_options(p.parse_args(["--config", str(f)])))
    assert (cfg.model.model, cfg.model.device) == ("demo-random", "cpu")
    assert (cfg.cache.gpu_kv_gb, cfg.cache.cache_policy, cfg.cache.swap_bandwidth_gbps,
            cfg.cache.decode_reserve) == (0.25, "prefix-lru", "off", 0.05)
    assert cfg.cache.policy is POLICIES["prefix-lru"]
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.batching) == (9, "separate")
    # what the file leaves out is the config's default; a flag given overrides the file
    assert cfg.cache.chunk_size == CacheConfig().chunk_size
    over = build_engine_config(**engine_options(p.parse_args(
        ["--config", str(f), "--gpu-kv-gb", "0.5", "--cache-policy", "lru", "opt-125m"])))
    assert (over.cache.gpu_kv_gb, over.cache.cache_policy, over.model.model) == (
        0.5, "lru", "opt-125m")
    assert over.scheduler.max_num_seqs == 9
    # no file, no flags: the dataclass defaults
    plain = build_engine_config(**engine_options(p.parse_args([])))
    assert plain.model.model == DEFAULT_MODEL and plain.cache == CacheConfig()


def test_config_file_formats(tmp_path: Path) -> None:
    toml = tmp_path / "e.toml"
    toml.write_text('chunk_size = 16\nenforce_eager = true\n[cache]\nnum_gpu_blocks = 40\n')
    assert load_config_file(toml) == {"chunk_size": 16, "enforce_eager": True,
                                      "num_gpu_blocks": 40}
    yaml = pytest.importorskip("yaml")
    y = tmp_path / "e.yaml"
    y.write_text(yaml.safe_dump({"defer-admission": 0, "gpu_kv_gb": 2,
                                 "swap_bandwidth_gbps": 22.5}))
    assert load_config_file(y) == {"defer_admission": 0, "gpu_kv_gb": 2.0,
                                   "swap_bandwidth_gbps": 22.5}


@pytest.mark.parametrize("content, match", [
    ({"gpu_kv": 1}, "unknown option 'gpu_kv'"),
    ({"cache_policy": "fifo"}, "cache_policy must be one of"),
    ({"max_num_seqs": "many"}, "max_num_seqs"),
    ({"max_num_seqs": 2.5}, "max_num_seqs must be a int"),
    ({"enforce_eager": "yes"}, "enforce_eager must be true or false"),
    ({"decode_reserve": 1.5}, "decode_reserve: expected a fraction"),
    ({"defer_admission": 1.5}, "defer_admission: expected a whole number"),
    ([1, 2], "expected a mapping"),
])
def test_config_file_refuses(tmp_path: Path, content: object, match: str) -> None:
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=match):
        load_config_file(f)
    with pytest.raises(ValueError, match="a config file is"):
        load_config_file(tmp_path / "engine.ini")


def test_generate_reads_the_config_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    f = tmp_path / "engine.json"
    f.write_text(json.dumps({"device": "cpu", "dtype": "float32", "num_gpu_blocks": 24,
                             "chunk_size": 16, "seed": 3}))
    argv = ["generate", "demo-random", "--config", str(f), "--num-prompts", "2",
            "--prompt-len", "10", "--max-tokens", "3", "--show", "0"]
    assert main([*argv, "--num-gpu-blocks", "20"]) == 0
    err = capsys.readouterr().err
    assert "kv_blocks=20 chunk=16" in err  # the file's chunk size, the flag's block count
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"gpu_kv": 1}))
    assert main(["generate", "demo-random", "--config", str(bad)]) == 2
    assert "unknown option 'gpu_kv'" in capsys.readouterr().err


def test_serve_reads_the_config_file(tmp_path: Path) -> None:
    from pensieve.server.main import build_server

    f = tmp_path / "engine.toml"
    f.write_text('device = "cpu"\ndtype = "float32"\nmax_model_len = 128\n'
                 '[cache]\nnum_gpu_blocks = 48\nnum_cpu_blocks = 16\ncache_policy = "lru"\n'
                 'tenant_kv_share = 0.5\n')
    p = argparse.ArgumentParser()
    add_serve_args(p)
    args = p.parse_args(["demo-random", "--config", str(f), "--num-cpu-blocks", "12",
                         "--no-engine-process", "--store", str(tmp_path / "c.db")])
    app, close = build_server(args)
    try:
        engine = app.state.pensieve.engine.engine
        cc = engine.config.cache
        assert (cc.num_gpu_blocks, cc.num_cpu_blocks, cc.cache_policy) == (48, 12, "lru")
        assert engine.config.scheduler.max_model_len == 128
        assert engine.cache.policy is cc.policy is POLICIES["lru"]
        assert engine.cache.cpu.num_blocks == 12
        assert cc.tenant_kv_share is None  # serve's --tenant-kv-share (auto, one tenant) decides
    finally:
        close()


def test_policy_object_is_passed_down() -> None:
    """The cache takes the policy object it is given: no second lookup by name (a policy
    that is in no registry still works), and the tier sizing asks the config's object."""
    custom = EvictionPolicy(name="custom-not-registered", uses_cpu_tier=False)
    cache = build_cache(TierSizes(10, 20, 64), float, CacheConfig(chunk_size=16), policy=custom)
    assert cache.policy is custom and cache.cpu is None
    assert CacheConfig(cache_policy="gpu-only").policy is POLICIES["gpu-only"]
    assert cpu_tier_blocks(CacheConfig(cache_policy="gpu-only", num_cpu_blocks=5), 64,
                           "cpu") == 0
    with pytest.raises(ValueError, match="unknown cache_policy"):
        CacheConfig(cache_policy="fifo")
    # the policy is derived, not an option: replace() and equality follow the name
    assert CacheConfig(cache_policy="lru") == CacheConfig(cache_policy="lru")


def test_the_cache_is_built_from_its_config_whole() -> None:
    """Every option of the cache has one default, the config's: a cache built from a default
    ``CacheConfig`` has it, and one built from another config has that one's."""
    cache = build_cache(TierSizes(10, 20, 64), float, CacheConfig(chunk_size=16,
                                                                   defer_admission=5))
    assert cache.defer_admission == 5
    default = TieredKVCache(8, 4, float, CacheConfig())
    assert default.defer_admission == CacheConfig().defer_admission
    assert (default.blocks is not None) == CacheConfig().share_prefixes
    assert default.share_across_tenants == CacheConfig().share_prefixes_across_tenants
    assert default.chunk_size == CacheConfig().chunk_size


def test_command_lines_settle_max_model_len_from_the_model() -> None:
    """``serve`` and ``generate`` take the model's own limit unless given, and refuse more;
    ``LLM()`` and the bare config keep DEFAULT_MAX_MODEL_LEN."""
    from pensieve.core.scheduling_config import DEFAULT_MAX_MODEL_LEN
    from pensieve.options import settle_model_options

    opts: dict[str, object] = {"model": "opt-125m"}
    settle_model_options(opts)
    assert opts["max_model_len"] == 2048  # OPT-125m's max_position_embeddings
    given: dict[str, object] = {"model": "opt-125m", "max_model_len": 1000}
    settle_model_options(given)
    assert given["max_model_len"] == 1000
    with pytest.raises(SystemExit, match="exceeds the model's max_position_embeddings"):
        settle_model_options({"model": "opt-125m", "max_model_len": 4096})
    assert SchedulerConfig().max_model_len == DEFAULT_MAX_MODEL_LEN == 16384
    assert "max_position_embeddings" in (_flags(_sub("generate"))["max_model_len"].help or "")
    assert _flags(_sub("serve"))["max_model_len"].help == _flags(
        _sub("generate"))["max_model_len"].help


def test_command_defaults_under_the_config_file(tmp_path: Path) -> None:
    """A benchmark's own defaults (``add_engine_args(defaults=...)``) sit between the
    config's and a ``--config`` file's: shown in the help, overridden by the file and by the
    flags; one of an option the command does not take is refused."""
    from pensieve.options import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p, model_flag=True, defaults={"model": "llama3.1-8b", "load_format": "dummy"})
    assert "(default: dummy)" in _flags(p)["load_format"].help
    assert "llama3.1-8b" in _flags(p)["model"].help
    assert engine_options(p.parse_args([])) == {"model": "llama3.1-8b", "load_format": "dummy"}
    f = tmp_path / "e.json"
    f.write_text(json.dumps({"load_format": "auto", "max_num_seqs": 4}))
    assert engine_options(p.parse_args(["--config", str(f), "--max-num-seqs", "5"])) == {
        "model": "llama3.1-8b", "load_format": "auto", "max_num_seqs": 5}
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        add_engine_args(argparse.ArgumentParser(), exclude=("kv_cache_dtype",),
                        defaults={"kv_cache_dtype": "fp8"})
