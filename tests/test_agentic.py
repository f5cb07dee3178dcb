"""The synthetic agentic workload: its shape, determinism, context cut, statistics and CLI."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from pensieve.bench import workload as wl
from pensieve.bench.agentic import agentic_workload, session_lifetime_s
from pensieve.bench.workload import Conversation, Turn, workload_stats


def test_agentic_shape() -> None:
    w = agentic_workload(4000, seed=3)
    assert w.name == "Agentic" and len(w) == 4000 and w.counts["kept"] == 4000
    turns = [len(c.turns) for c in w.conversations]
    assert min(turns) >= 8 and max(turns) <= 24
    assert statistics.median(turns) == 12
    ins = [t.input_len for c in w.conversations for t in c.turns]
    outs = [t.output_len for c in w.conversations for t in c.turns]
    assert 270 <= statistics.mean(ins) <= 360
    assert max(ins) > 1500  # tool outputs: a heavy tail
    assert min(outs) >= 60 and max(outs) <= 220
    assert 95 <= statistics.mean(outs) <= 115
    # contexts grow past 4k tokens in a typical session
    assert statistics.median(c.total_tokens for c in w.conversations) > 4000
    s = workload_stats(w)
    assert s["p50_turns"] == 12 and s["mean_turn_context"] > 2000


def test_agentic_deterministic_and_cut() -> None:
    a = agentic_workload(300, seed=11)
    b = agentic_workload(300, seed=11)
    c = agentic_workload(300, seed=12)
    assert [x.turns for x in a.conversations] == [x.turns for x in b.conversations]
    assert [x.turns for x in a.conversations] != [x.turns for x in c.conversations]
    small = agentic_workload(300, seed=11, max_context=2000)
    assert all(x.total_tokens <= 2000 and len(x.turns) >= 1 for x in small.conversations)
    assert small.counts["truncated"] > 0 and len(small) == 300
    with pytest.raises(ValueError):
        agentic_workload(-1)


def test_session_lifetime() -> None:
    convs = [Conversation("a", [Turn(10, 100), Turn(10, 50)]), Conversation("b", [Turn(5, 10)])]
    # a: 2 x 0.2 s + 150 tokens x 0.02 s + one 5 s think; b: 0.2 + 0.2
    assert session_lifetime_s(convs, 5.0) == pytest.approx(((0.4 + 3.0 + 5.0) + 0.4) / 2)
    assert session_lifetime_s([], 5.0) == 0.0


def test_workload_stats_cli_lists_agentic(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    cache = wl.save_workload(wl.Workload("ShareGPT", [Conversation("a", [Turn(10, 100)])]),
                             tmp_path / "c.json.gz")
    assert wl.main(["--sharegpt", str(cache), "--ultrachat-n", "200", "--agentic-n", "500"]) == 0
    out = capsys.readouterr().out
    assert "Agentic (ours)" in out and "Agentic (paper)" not in out
    assert "UltraChat (paper)" in out and "mean context a turn is sent with" in out
    assert wl.main(["--sharegpt", str(cache), "--ultrachat-n", "0", "--agentic-n", "500",
                    "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ours"]["Agentic"]["conversations"] == 500
    assert doc["ours"]["Agentic"] == workload_stats(agentic_workload(500, seed=0))


def test_multiturn_registers_agentic(multiturn_module: Any) -> None:
    mt = multiturn_module
    args = argparse.Namespace(workload="agentic", num_conversations=50, seed=4, sharegpt=None,
                              shared_prefix_tokens=0)
    w = mt.workload(args)
    assert w.name == "Agentic" and len(w) == 50
    assert [c.turns for c in w.conversations] == [
        c.turns for c in agentic_workload(50, seed=4).conversations]
