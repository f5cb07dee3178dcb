"""``benchmarks/scheduler_cost.py``: the scheduler + cache host-cost
microbenchmark, at tiny sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import scheduler_cost

TINY = ["--steps", "30", "--warmup-steps", "10", "--waiting", "6", "--max-num-seqs", "4",
        "--budget", "512", "--output-tokens", "5,20", "--gpu-batch", "1.0", "--cpu-frac", "0.2",
        "--no-progress"]


SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "scheduler_cost.py"


def test_help_of_the_script() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"],
                         capture_output=True, text=True, check=True)
    assert "--sessions" in out.stdout and "--out" in out.stdout and "--preset" in out.stdout


def test_cli_run_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "cli.json"
    res = subprocess.run([sys.executable, str(SCRIPT),
                          "--sessions", "8", *TINY, "--out", str(out)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    assert data["args"]["sessions"] == "8" and data["rows"][0]["sessions"] == 8


def test_tiny_run_writes_json_and_plot_without_torch(tmp_path: Path) -> None:
    out, png = tmp_path / "cost.json", tmp_path / "cost.png"
    argv = ["--sessions", "8,16", *TINY, "--label", "tiny", "--out", str(out)]
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(SCRIPT.parent)!r})\n"
        "from scheduler_cost import main\n"
        f"main({argv!r})\n"
        "heavy = [m for m in ('torch', 'triton', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "median ms" in res.stdout
    data = json.loads(out.read_text())
    assert data["label"] == "tiny" and [r["sessions"] for r in data["rows"]] == [8, 16]
    for r in data["rows"]:
        assert r["steps"] == 30 and r["median_ms"] > 0 and r["p90_ms"] >= r["median_ms"]
        assert r["chunks_held"] > 0 and r["running_mean"] > 0
    # the tiers are small next to the sessions' KV: chunks moved between them
    moved = sum(r["swapped_out_chunks_per_step"] + r["dropped_chunks_per_step"]
                for r in data["rows"])
    assert moved > 0
    # the plot, with the run drawn against itself as the comparison
    scheduler_cost.main(["--sessions", "8", "--steps", "5", "--warmup-steps", "0",
                         "--max-num-seqs", "4", "--budget", "512", "--no-progress",
                         "--plot", str(png), "--compare", str(out)])
    assert png.stat().st_size > 1000


def test_long_preset_holds_long_block_tables(tmp_path: Path) -> None:
    prof = tmp_path / "p.prof"
    res = scheduler_cost.main(["--preset", "long", "--sessions", "4", "--steps", "6",
                               "--warmup-steps", "2", "--waiting", "2", "--no-progress",
                               "--profile", str(prof)])
    r = res["rows"][0]
    assert res["args"]["max_model_len"] == 131072
    assert list(res["args"]["seed_tokens"]) == [65536, 122000]
    assert r["longest_block_table"] >= 2048 and r["mean_context_tokens"] > 60000
    assert prof.stat().st_size > 0


def test_options_given_win_over_the_preset() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    scheduler_cost.add_arguments(ap)
    a = scheduler_cost.resolve(ap.parse_args(["--preset", "long", "--max-num-seqs", "7"]))
    assert a.max_num_seqs == 7 and a.max_model_len == 131072
    d = scheduler_cost.resolve(ap.parse_args([]))
    assert d.seed_tokens == (2000, 8000) and d.max_model_len == 16384
    with pytest.raises(SystemExit):
        ap.parse_args(["--seed-tokens", "9,3"])


def test_repeats_report_each_steps_least_time() -> None:
    """With ``--repeat``, each step's least time over the runs (same work step by step): its
    median is at most every run's median (a pointwise lower bound), and the per-step times
    stay out of the JSON."""
    res = scheduler_cost.main(["--sessions", "8", "--steps", "12", "--warmup-steps", "2",
                               "--max-num-seqs", "4", "--budget", "512", "--repeat", "3",
                               "--no-progress"])
    r = res["rows"][0]
    assert len(r["repeat_median_ms"]) == 3
    assert 0 < r["min_step_median_ms"] <= min(r["repeat_median_ms"])
    assert "_times" not in r


def test_a_shared_prefix_is_held_once_and_stepped_over() -> None:
    """``--shared-prefix-tokens`` with ``--share-prefixes``: every session opens with the same
    tokens, so the cache holds them once (shared GPU blocks after seeding) and the steps run
    with the shared blocks in the retention order."""
    import argparse

    ap = argparse.ArgumentParser()
    scheduler_cost.add_arguments(ap)
    a = scheduler_cost.resolve(ap.parse_args(
        TINY + ["--share-prefixes", "--shared-prefix-tokens", "256",
                "--seed-tokens", "100,200"]))
    b = scheduler_cost.Bench(8, a, seed=0)
    blocks = b.cache.blocks
    assert blocks is not None
    assert len(blocks.gpu.shared) + len(blocks.cpu.shared) >= 256 // 32 - 1
    assert all(c.token_ids[:256] == [1] * 256 for c in b.cache.conversations.values())
    for _ in range(30):
        b.step()
    b.cache.check_integrity()
