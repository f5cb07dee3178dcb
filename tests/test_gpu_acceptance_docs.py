"""scripts/gpu_acceptance_docs.py on a small output directory built from what the benchmarks
write (rows of recorded long_attention.py and multiturn.py results, step_totals.py's own JSON):
the tables carry the card and the right ratios, the plot is written, the doc's section is
replaced and nothing around it; and scripts/gpu_acceptance.sh parses."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
CARD = "NVIDIA H100 80GB HBM3, 81559 MiB, 570.86.15"


def _docs() -> Any:
    spec = importlib.util.spec_from_file_location(
        "gpu_acceptance_docs", ROOT / "scripts" / "gpu_acceptance_docs.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


METRICS = """\
pensieve_steps_total{kind="prefill"} 100
pensieve_steps_total{kind="decode"} 400
pensieve_step_execute_seconds_total{kind="prefill"} 25.0
pensieve_step_execute_seconds_total{kind="decode"} 6.0
pensieve_computed_tokens_total{kind="prefill"} 400000
pensieve_scheduler_seconds_total{kind="schedule"} 0.2
pensieve_scheduler_seconds_total{kind="update"} 0.05
"""


def _out_dir(tmp: Path) -> Path:
    out = tmp / "out"
    out.mkdir()
    (out / "acceptance.txt").write_text(
        f"card: {CARD}\ncommit: abc1234 stages: tests attention agent steps  budget 540 s\n"
        "[2 s] stage tests: up to 200 s\nstage tests rc=0 s=181\n"
        "stage attention rc=124 s=90\nstage agent: pensieve 0.07 bf16 rc=0 s=150\n")
    (out / "gpu_tests.txt").write_text("....\n141 passed, 566 deselected in 181.46s (0:03:01)\n")
    rows = json.loads((ROOT / "docs/results/long_context/long_attention_graphs.json")
                      .read_text())["rows"]
    keep = [{k: v for k, v in r.items() if not k.startswith(("sweep", "best"))}
            for r in (rows[0], rows[3])]  # prefill and decode x1 at 32k
    (out / "long_attention.json").write_text(json.dumps({"device": "x", "rows": keep}))
    point = (ROOT / "docs/results/agent_serving/coding-agent_fp8_0.07/points.jsonl"
             ).read_text().splitlines()[0]
    (out / "points.jsonl").write_text(point + "\n")
    (tmp / "metrics_end.txt").write_text(METRICS)
    import step_totals  # benchmarks/ is on the tests' path

    assert step_totals.main([str(tmp / "metrics_end.txt"), "--json",
                             str(out / "step_totals.json")]) == 0
    return out


def test_tables_and_plot(tmp_path: Path) -> None:
    mod = _docs()
    out = _out_dir(tmp_path)
    png = tmp_path / "docs" / "results" / "acc.png"
    md = tmp_path / "acc.md"
    assert mod.main([str(out), "--plot", str(png), "--md", str(md)]) == 0
    text = md.read_text()
    assert "NVIDIA H100 80GB HBM3" in text and "`abc1234`" in text
    assert "| tests | 0 | 181 |" in text and "| attention | 124 | 90 |" in text
    assert "141 passed, 566 deselected" in text
    # prefill at 32k, graph replays: ours bf16 3.397 ms / SDPA 3.091 ms, FP8 4.156 ms
    assert "| 32k | prefill 2048 | 3.091 | 3.397 | 4.156 | 1.10x | 1.34x | 1.22x |" in text
    assert "| 32k | decode x1 | 0.037 | 0.042 | 0.035 | 1.13x | 0.93x | 0.82x |" in text
    # the FP8 point: TTFT 0.405 / 1.024 s, 221,420 tokens computed over 109 requests
    assert "| fp8 @ 0.07 | 32-92 (109) | 1.82 | 0.41 / 1.02 |" in text
    assert "| 2,031 |" in text and "no: cpu_blocks_used, requests_running" in text
    # 25 s over 400k prefill tokens = 62.5 us; net of 100 x 15 ms decode steps: 58.8 us
    assert "| 62.5 (58.8) | 250.0 (0.0) | 15.0 (0.00) | 0.500 |" in text
    assert png.exists() and 5_000 < png.stat().st_size < 150_000
    assert f"]({png})" in text


def test_missing_parts_leave_their_sections_out(tmp_path: Path) -> None:
    mod = _docs()
    out = tmp_path / "out"
    out.mkdir()
    (out / "acceptance.txt").write_text(f"card: {CARD}\ncommit: abc1234\n")
    text = mod.markdown(mod.load(out))
    assert "NVIDIA H100" in text
    assert "Attention" not in text and "Coding-agent" not in text and "GPU tests" not in text
    assert mod.plot(mod.load(out), tmp_path / "none.png") is False


def test_update_doc_replaces_only_its_section(tmp_path: Path) -> None:
    mod = _docs()
    out = _out_dir(tmp_path)
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Title\nbefore\n{mod.START}\nold table\n{mod.END}\nafter\n")
    assert mod.main([str(out), "--update-doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith(f"# Title\nbefore\n{mod.START}\n`scripts/gpu_acceptance.sh` on NVIDIA")
    assert "old table" not in text and text.endswith(f"{mod.END}\nafter\n")
    assert mod.main([str(out), "--update-doc", str(doc)]) == 0
    assert doc.read_text() == text  # the same input, the same doc
    doc.write_text("no markers\n")
    with pytest.raises(ValueError):
        mod.update_doc(doc, "x")


def test_acceptance_script_parses_and_runs_every_stage() -> None:
    script = ROOT / "scripts" / "gpu_acceptance.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    for part in ("gpu_tests.sh", "long_attention.py", "agent_points.sh", "step_totals.py",
                 "nvidia-smi", "TRITON_CACHE_DIR", ".whl", "timeout"):
        assert part in text


def test_merge_attention_folds_the_fp8dot_run_in(tmp_path: Path) -> None:
    """The acceptance script runs each context apart and the FP8 e4m3-dot prefill apart; the
    merge keeps every row once and puts the fp8dot fields into the matching prefill row."""
    mod = _docs()
    rows = json.loads((ROOT / "docs/results/long_context/long_attention_graphs.json")
                      .read_text())["rows"]
    a = {"device": "x", "rows": [rows[0], rows[3]]}  # 32k: prefill, decode x1
    dot = {"device": "x", "rows": [{"context": 32768, "query_len": 2048, "batch": 1,
                                    "sdpa_graph_s": 0.003, "ours_fp8dot_s": 0.0031,
                                    "ours_fp8dot_graph_s": 0.0030}]}
    for name, d in (("la_32768.json", a), ("la_fp8dot.json", dot)):
        (tmp_path / name).write_text(json.dumps(d))
    out = tmp_path / "long_attention.json"
    assert mod.main(["--merge-attention", str(out), str(tmp_path / "la_32768.json"),
                     str(tmp_path / "la_fp8dot.json")]) == 0
    merged = json.loads(out.read_text())["rows"]
    assert len(merged) == 2 and merged[0]["ours_fp8dot_graph_s"] == 0.0030
    assert "ours_fp8dot_s" not in merged[1]
    table = "\n".join(mod.attention_table(merged, "H100"))
    # 3.0 ms over ours bf16's 3.397 ms (graph replays)
    assert "| 32k | prefill 2048 | 3.091 | 3.397 | 4.156 | 1.10x | 1.34x | 1.22x | 0.88x |" in table
    assert "| 32k | decode x1 |" in table and table.rstrip().endswith("| - |")
