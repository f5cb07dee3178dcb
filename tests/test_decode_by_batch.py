"""``benchmarks/decode_by_batch.py``: decode-only steps of several runs at matched batch
sizes."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from bench_scripts import load


def _step(t: float, decodes: int, ms: float, prefill: int = 0, ahead: int = 0) -> dict:
    return {"t": t, "prefill_tokens": prefill, "decode_tokens": decodes,
            "step_time_s": ms / 1e3, "swap_in_ahead": ahead, "swap_outs_in_flight": 0}


def _log(path: Path, rows: list[dict]) -> str:
    with gzip.open(path, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_bins_match_batches_and_drop_prefill_and_out_of_window_steps() -> None:
    mod = load("decode_by_batch")
    rows = [_step(5, 42, 18.0), _step(6, 47, 20.0), _step(7, 45, 99.0, prefill=10),
            _step(1, 44, 99.0), _step(8, 55, 21.0, ahead=4), _step(9, 0, 99.0)]
    bins = mod.decode_bins(rows, (2.0, 10.0), 10)
    assert bins == {40: [0.018, 0.020], 50: [0.021]}
    assert mod.decode_bins(rows, (2.0, 10.0), 10, quiet=True) == {40: [0.018, 0.020]}


def test_compare_keeps_bins_every_run_holds(tmp_path: Path, capsys: pytest.CaptureFixture
                                            ) -> None:
    mod = load("decode_by_batch")
    a = [_step(t, 40 + t % 10, 20.0) for t in range(100)] + [_step(5, 65, 30.0)]
    b = [_step(t, 40 + t % 10, 18.0) for t in range(100)] + [_step(5, 75, 30.0)]
    pa, pb = _log(tmp_path / "a.jsonl.gz", a), _log(tmp_path / "b.jsonl.gz", b)
    assert mod.main([pa, pb, "--labels", "head", "direct", "--min-steps", "1",
                     "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("40-49"))
    assert line.split() == ["40-49", "100", "100", "20.00", "18.00", "0.900"]
    assert "60-69" not in out and "70-79" not in out  # held by one run only
    assert (tmp_path / "p.png").stat().st_size > 0
    rows = mod.compare([mod.decode_bins(a, (0, 1e9), 10), mod.decode_bins(b, (0, 1e9), 10)],
                       ["head", "direct"], 10, min_steps=101)
    assert rows == []  # fewer steps than asked for in the bin
    with pytest.raises(SystemExit):
        mod.main([pa, pb, "--labels", "only-one"])
