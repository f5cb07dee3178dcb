"""``python benchmarks/cpu_prefill.py`` on the demo model: the table and the JSON it writes."""

import json
from pathlib import Path

import pytest
from cpu_prefill import main

from pensieve.core.scheduling_config import STEP_TOKEN_BUDGETS


def test_cpu_prefill_writes_every_point(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "r.json"
    n = STEP_TOKEN_BUDGETS["cpu"] + 44
    assert main(["--model", "demo", "--lengths", "40", str(n), "--repeats", "2", "--one-step",
                 "--threads", "1", "--output", str(out), "--no-progress"]) == 0
    res = json.loads(out.read_text())
    assert res["meta"]["budgets"] == {"pensieve": STEP_TOKEN_BUDGETS["cpu"],
                                      "pensieve-one-step": n + 1}
    points = {p["prompt_len"]: p for p in res["points"]}
    assert sorted(points) == [40, n]
    assert points[40]["steps"] == {"pensieve": 1, "pensieve-one-step": 1}
    assert points[n]["steps"] == {"pensieve": 2, "pensieve-one-step": 1}
    for p in points.values():
        systems = {"hf", "pensieve", "pensieve-one-step"}
        assert set(p["seconds"]) == set(p["cpu_seconds"]) == systems
        assert all(v > 0 for v in p["seconds"].values())
        assert 0 < p["max_step_s"]["pensieve"] <= p["seconds"]["pensieve"]
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:2] == ["prompt", "hf"] and len(table) == 3
