"""``benchmarks/swap_in_out_table.py``: the in + out rows of ``swap_out_order.sh``'s runs."""

from __future__ import annotations

import json
from pathlib import Path

from bench_scripts import load


def _run(path: Path, raw: float, inout: float, out: float, ins_s: float) -> None:
    rows = [{"method": "raw 2 streams", "dir": "in+out", "chunks": 0, "gbps": raw},
            {"method": "staged", "dir": "out", "chunks": 64, "gbps": out, "step_s": 0.001},
            {"method": "staged", "dir": "in+out", "chunks": 64, "gbps": inout,
             "step_s": ins_s},
            {"method": "staged", "dir": "in", "chunks": 64, "gbps": 99.0, "step_s": 0.5}]
    path.write_text(json.dumps({"rows": rows}))


def test_table_ranges_per_order_and_groups(tmp_path: Path) -> None:
    mod = load("swap_in_out_table")
    _run(tmp_path / "bw_first_g8_1.json", 50.0, 45.0, 48.0, 0.009)
    _run(tmp_path / "bw_first_g8_2.json", 48.0, 47.0, 49.0, 0.0095)
    _run(tmp_path / "bw_after_1.json", 49.0, 38.0, 46.0, 0.0085)  # before groups: g1
    (tmp_path / "bw_first_g8_1.txt").write_text("not json")  # ignored
    runs = mod.load(tmp_path)
    assert [(r["order"], r["groups"], r["round"]) for r in runs] == [
        ("after", 1, 1), ("first", 8, 1), ("first", 8, 2)]
    text = mod.table(runs)
    assert "first g8    64 chunks: in + out 45.0-47.0 GB/s each way (median 46.0, 2 runs)" in text
    assert "of raw 90%-98%; out alone 48.0-49.0; swap-ins done 9.00-9.50 ms" in text
    assert "after g1    64 chunks: in + out 38.0-38.0" in text
