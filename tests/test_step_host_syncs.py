"""``benchmarks/step_host_syncs.py`` on the CPU: eager mixed steps with and without swap-ins
through the runner, their host times reported, and no device sync (there is no device)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from bench_scripts import load

load("decode_step")  # the script's sibling imports
load("mixed_step")


def test_mixed_step_swaps_the_history_in() -> None:
    mod = load("step_host_syncs")
    sched = mod.mixed(2, 64, 40, 64, 2, 32, random.Random(0), 64)
    assert len(sched.requests) == 3
    new = sched.requests[-1]
    assert new.ranges[0].start_pos == 64 and len(new.ranges[0].token_ids) == 40
    assert sched.swaps.swap_in == [(0, new.block_table[0]), (1, new.block_table[1])]


def test_runs_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = load("step_host_syncs")
    out = tmp_path / "syncs.json"
    monkeypatch.setattr(sys, "argv", [
        "step_host_syncs.py", "--model", "llama-tiny", "--dtype", "float32",
        "--configs", "2x64x32", "--history", "64", "--swap-in", "0", "2",
        "--kv-gb", "0.01", "--iters", "1", "--out", str(out)])
    mod.main()
    rows = json.loads(out.read_text())["rows"]
    assert [r["swap_in"] for r in rows] == [0, 2]
    for r in rows:
        assert 0 < r["host_prepare_ms"] <= r["host_issue_ms"] <= r["step_time_ms"]
        assert r["syncs_per_step"] == {}
