"""scripts/size_check.py: the line limits on source files and the byte limit on the recorded
results, each failing the check when broken, and the tree itself within them."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "size_check.py"


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def _limit() -> int:
    spec = importlib.util.spec_from_file_location("size_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return int(mod.MAX_RESULTS_BYTES)


def test_results_over_the_limit_fail(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "big.json").write_bytes(b"0" * (_limit() - 10))
    (tmp_path / "small.csv").write_bytes(b"1" * 10)
    ok = _check(str(tmp_path / "empty_src"), "--results", str(tmp_path))
    assert ok.returncode == 0, ok.stdout
    (tmp_path / "one_more.txt").write_bytes(b"x")
    over = _check(str(tmp_path / "empty_src"), "--results", str(tmp_path))
    assert over.returncode == 1
    assert f"{_limit() + 1} bytes" in over.stdout and "big.json" in over.stdout


def test_long_source_file_fails(tmp_path: Path) -> None:
    (tmp_path / "long.py").write_text("x = 1\n" * 600)
    assert _check(str(tmp_path)).returncode == 0  # 600 lines: within the limit
    (tmp_path / "long.py").write_text("x = 1\n" * 601)
    r = _check(str(tmp_path))
    assert r.returncode == 1 and "601 lines (limit 600)" in r.stdout


def test_long_function_fails(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(79))
    (tmp_path / "f.py").write_text(f"def f():\n{body}")  # 80 lines
    assert _check(str(tmp_path)).returncode == 0
    (tmp_path / "f.py").write_text(f"def f():\n{body}    return 0\n")  # 81 lines
    r = _check(str(tmp_path))
    assert r.returncode == 1 and "f() 81 lines (limit 80)" in r.stdout


def test_the_tree_is_within_the_limits() -> None:
    r = _check("src", "--results", "docs/results")
    assert r.returncode == 0, r.stdout
