"""``benchmarks/swap_in_out_table.py``: the in + out rows of ``swap_out_order.sh``'s runs."""

from __future__ import annotations

import json
from pathlib import Path

from bench_scripts import load


def _run(path: Path, raw: float, inout: float, out: float, ins_s: float,
         steps_gbps: float | None = None) -> None:
    rows = [{"method": "raw 2 streams", "dir": "in+out", "chunks": 0, "gbps": raw},
            {"method": "staged", "dir": "out", "chunks": 64, "gbps": out, "step_s": 0.001},
            {"method": "staged", "dir": "in+out", "chunks": 64, "gbps": inout,
             "step_s": ins_s},
            {"method": "staged", "dir": "in", "chunks": 64, "gbps": 99.0, "step_s": 0.5}]
    if steps_gbps is not None:
        rows.append({"method": "staged", "dir": "in+out x8", "chunks": 64, "steps": 8,
                     "gbps": steps_gbps, "step_s": ins_s + 0.001})
        rows.append({"method": "hybrid", "dir": "in+out x8", "chunks": 64, "steps": 8,
                     "gbps": 1.0, "step_s": 1.0})  # another method: ignored
    path.write_text(json.dumps({"rows": rows}))


def test_table_ranges_per_order_and_groups(tmp_path: Path) -> None:
    mod = load("swap_in_out_table")
    _run(tmp_path / "bw_first_g8_1.json", 50.0, 45.0, 48.0, 0.009, steps_gbps=46.0)
    _run(tmp_path / "bw_first_g8_2.json", 48.0, 47.0, 49.0, 0.0095, steps_gbps=44.0)
    _run(tmp_path / "bw_after_1.json", 49.0, 38.0, 46.0, 0.0085)  # before groups: g1
    (tmp_path / "bw_first_g8_1.txt").write_text("not json")  # ignored
    runs = mod.load(tmp_path)
    assert [(r["order"], r["groups"], r["round"]) for r in runs] == [
        ("after", 1, 1), ("first", 8, 1), ("first", 8, 2)]
    text = mod.table(runs)
    assert "first g8    64 chunks: in + out 45.0-47.0 GB/s each way (median 46.0, 2 runs)" in text
    assert "of raw 90%-98%; out alone 48.0-49.0; swap-ins done 9.00-9.50 ms" in text
    assert "after g1    64 chunks: in + out 38.0-38.0" in text
    assert "first g8    64 chunks x8 steps: in + out 44.0-46.0 GB/s each way (median 45.0, " \
        "2 runs), of raw 92%-92%; a step's swap-ins done 10.00-10.50 ms" in text
    assert "x8 steps 46.0 GB/s, ins 10.00 ms" in text  # the run's own line
    assert "after g1    64 chunks x8" not in text  # a run without the steps row
