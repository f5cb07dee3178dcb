"""``pensieve bench multiturn``'s engine options: generated from the config (pensieve.options)
under the benchmark's own defaults, ``--config FILE`` over those and the flags over the file;
the real engine and the simulator are built from the one settled set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pensieve.bench import multiturn
from pensieve.bench.engine_api import VirtualClock
from pensieve.config import owners
from pensieve.engine.llm import build_engine_config
from pensieve.engine.tiers import gib_blocks

PAPER = {"model": "llama2-13b-gqa10", "load_format": "dummy", "dtype": "bfloat16",
         "device": "auto", "gpu_kv_gb": 40.0, "cpu_kv_gb": 220.0, "max_model_len": 16384,
         "max_num_batched_tokens": 8192, "max_num_seqs": 256, "chunk_size": 32,
         "swap_in_ahead_chunks": 256, "batching": "unified", "seed": 0}
"""The values the benchmark ran with before its engine options were generated."""


def test_defaults_are_the_papers_setting() -> None:
    args = multiturn.parse_args([])
    assert {k: getattr(args, k) for k in PAPER} == PAPER
    # what the engines are built from: only what is set, the rest the config's defaults
    assert args.engine_options == multiturn.ENGINE_DEFAULTS


def test_every_engine_option_is_generated_once() -> None:
    p = multiturn.build_parser()
    dests = [a.dest for a in p._actions]
    for name in owners():  # one flag each, none hand-written beside it; no --cache-policy
        assert dests.count(name) == (0 if name == "cache_policy" else 1), name
    seed = next(a for a in p._actions if a.dest == "seed")
    assert "load" in seed.help  # the benchmark's own seed, not the engine's
    assert "cache_policy" in multiturn.NOT_ENGINE  # --systems names the policies
    gpu = next(a for a in p._actions if a.dest == "gpu_kv_gb")
    assert "this command's default: 40.0" in gpu.help


def test_the_flags_scripts_pass_still_parse() -> None:
    args = multiturn.parse_args([
        "--model", "opt-125m", "--load-format", "dummy", "--dtype", "float16", "--device", "cpu",
        "--gpu-kv-gb", "4", "--cpu-kv-gb", "22", "--max-model-len", "4096",
        "--max-num-batched-tokens", "512", "--max-num-seqs", "8", "--chunk-size", "16",
        "-tp", "2", "--enforce-eager", "--no-mixed-graphs", "--swap-in-ahead-chunks", "0",
        "--batching", "separate", "--seed", "3", "--cost-profile", "c.json"])
    assert args.engine_options == {
        "model": "opt-125m", "load_format": "dummy", "dtype": "float16", "device": "cpu",
        "gpu_kv_gb": 4.0, "cpu_kv_gb": 22.0, "max_model_len": 4096,
        "max_num_batched_tokens": 512, "max_num_seqs": 8, "chunk_size": 16,
        "tensor_parallel_size": 2, "enforce_eager": True, "cuda_graph_mixed": False,
        "swap_in_ahead_chunks": 0, "batching": "separate", "cost_profile": "c.json"}
    assert (args.seed, args.batching, args.gpu_kv_gb) == (3, "separate", 4.0)


def test_config_file_over_the_benchmark_defaults_under_the_flags(tmp_path: Path) -> None:
    f = tmp_path / "e.json"
    f.write_text(json.dumps({"cache": {"gpu_kv_gb": 4, "cpu_kv_gb": 22},
                             "scheduler": {"max_num_seqs": 9}}))
    args = multiturn.parse_args(["--config", str(f), "--cpu-kv-gb", "8"])
    assert (args.gpu_kv_gb, args.cpu_kv_gb, args.max_num_seqs) == (4.0, 8.0, 9)
    assert args.model == "llama2-13b-gqa10"  # left to the benchmark's default
    cfg = build_engine_config(**{**args.engine_options, "cache_policy": "pensieve"})
    assert (cfg.cache.gpu_kv_gb, cfg.cache.cpu_kv_gb, cfg.scheduler.max_num_seqs) == (
        4.0, 8.0, 9)
    f.write_text(json.dumps({"batching": "separate"}))
    with pytest.raises(SystemExit):  # a file's batching is checked as the flag is
        multiturn.parse_args(["--config", str(f), "--engine", "http", "--url", "http://x"])


def test_sim_tiers_and_scheduler_from_the_options(tmp_path: Path) -> None:
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"base_s": 0.01, "per_prefill_token_s": 1e-5,
                                "per_decode_token_s": 1e-4}))
    args = multiturn.parse_args(["--engine", "sim", "--step-cost", str(cost),
                                 "--gpu-kv-gb", "0.5", "--cpu-kv-gb", "2",
                                 "--max-num-seqs", "7", "--chunk-size", "16",
                                 "--prefill-attention-pairs", "1000000"])
    eng = multiturn.build_sim("lru", args, VirtualClock())
    block_bytes = args.kv_bytes_per_token * 16
    assert (eng.executor.tiers.num_gpu_blocks, eng.executor.tiers.num_cpu_blocks) == (
        gib_blocks(0.5, block_bytes), gib_blocks(2, block_bytes))
    sc = eng.scheduler.config
    assert (sc.max_num_seqs, sc.max_num_batched_tokens, sc.max_model_len,
            sc.prefill_attention_pairs) == (7, 8192, 16384, 1000000)
    assert eng.scheduler.cache.policy.name == "lru"
