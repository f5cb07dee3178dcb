"""benchmarks/scheduler_cost.py: the scheduler + cache host-cost microbenchmark, at tiny sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "scheduler_cost.py"


def test_help() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True,
                         text=True, check=True)
    assert "--sessions" in out.stdout and "--out" in out.stdout


def test_tiny_run_writes_json_and_plot_without_torch(tmp_path: Path) -> None:
    out, png = tmp_path / "cost.json", tmp_path / "cost.png"
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['scheduler_cost.py', '--sessions', '8,16', '--steps', '30', "
        f"'--warmup-steps', '10', '--waiting', '6', '--max-num-seqs', '4', '--budget', '512', "
        f"'--output-tokens', '5,20', '--gpu-batch', '1.0', '--cpu-frac', '0.2', '--label', 'tiny', "
        f"'--out', {str(out)!r}]\n"
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
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
    subprocess.run([sys.executable, str(SCRIPT), "--sessions", "8", "--steps", "5",
                    "--warmup-steps", "0", "--max-num-seqs", "4", "--budget", "512",
                    "--plot", str(png), "--compare", str(out)], check=True,
                   capture_output=True)
    assert png.stat().st_size > 1000
