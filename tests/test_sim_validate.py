"""benchmarks/sim_validate_churn.py at tiny size: reads the real churn points, runs the
simulator on a short, scaled-down version of their load, recalibrates, writes its outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "sim_validate_churn.py"


@pytest.mark.slow  # fits and simulates every real churn point, even at tiny size
def test_sim_validate_churn_tiny(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    r = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--workers", "1",
                        "--whatif-systems", "stateless,pensieve", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads((tmp_path / "sim_validate_churn.json").read_text())
    assert len(d["real"]) == 6  # three pairs of the current engine
    assert {p["system"] for p in d["real"]} == {"stateless", "pensieve", "prefix-lru"}
    assert all(p["prefill_steps"] > 0 and p["decode_step_s"] > 0 for p in d["real"])
    assert set(d["models"]) == {"fit_one", "fit_all"}
    assert len(d["held_out"]) == 2 and d["fit_pair"] not in d["held_out"]
    for name in ("fused fit as is", "held out (fit on one pair)", "all-pairs fit (in-sample)"):
        assert len(d["sim"][name]) == 6
    assert d["copies"]["source"].endswith("[hybrid, random]")
    assert len(d["whatif"]) == 2
    assert (tmp_path / "sim_validate_churn.png").stat().st_size > 0
    assert (tmp_path / "step_cost_churn_fit_all.json").exists()


def test_sim_churn_capacity_tiny(tmp_path: Path) -> None:
    """benchmarks/sim_churn_capacity.py at tiny size: every (system, rate) point is run and a
    capacity is reported per target for each system."""
    pytest.importorskip("matplotlib")
    script = ROOT / "benchmarks" / "sim_churn_capacity.py"
    r = subprocess.run([sys.executable, str(script), "--tiny", "--workers", "1", "--rates",
                        "0.5,1.0", "--systems", "stateless,pensieve", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads((tmp_path / "sim_churn_capacity.json").read_text())
    assert {(p["system"], p["conv_rate"]) for p in d["points"]} == {
        (s, x) for s in ("stateless", "pensieve") for x in (0.5, 1.0)}
    assert set(d["capacity"]) == {"50ms", "100ms", "150ms"}
    assert all(set(c) == {"stateless", "pensieve"} for c in d["capacity"].values())
    assert (tmp_path / "sim_churn_capacity.png").stat().st_size > 0
