"""What the package ships and what stays in the repository: ``src/pensieve`` never imports a
script of ``benchmarks/`` (microbenchmarks, simulator studies, log analysis: not in the wheel),
the simulator (``pensieve.sim``) imports nothing of the load generator (``pensieve.bench``),
and every ``benchmarks/X.py`` and ``pensieve bench SUB`` the current docs name exists (but a
script cited at a commit).
Checked on the syntax trees and the text; nothing is imported but the CLI's parser."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "pensieve"
SCRIPTS = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}


def _imports(path: Path) -> set[str]:
    """The dotted names a module imports (``from a.b import c``: ``a.b`` and ``a.b.c``)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _docs() -> list[Path]:
    return [ROOT / "README.md", ROOT / "benchmarks" / "README.md",
            *sorted(p for p in (ROOT / "docs").glob("*.md") if not p.stem.endswith("_history"))]


def test_the_package_imports_no_benchmark_script() -> None:
    assert {"swap_bandwidth", "sim_churn_jobs", "step_totals"} <= SCRIPTS
    found = [f"{p.relative_to(ROOT)}: {name}" for p in sorted(PACKAGE.rglob("*.py"))
             for name in _imports(p) if name.split(".")[0] in SCRIPTS]
    assert found == []


def test_the_simulator_does_not_import_the_load_generator() -> None:
    found = [f"{p.name}: {name}" for p in sorted((PACKAGE / "sim").glob("*.py"))
             for name in _imports(p) if name.startswith("pensieve.bench")]
    assert found == []
    # and the load generator reaches the simulator only where it runs it (multiturn)
    users = sorted(p.name for p in (PACKAGE / "bench").glob("*.py")
                   if any(n.startswith("pensieve.sim") for n in _imports(p)))
    assert users == ["multiturn.py"]


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_commands_the_docs_name_exist(doc: Path) -> None:
    from pensieve.cli import build_parser

    # a script at a commit (`sha:benchmarks/x.py`, `benchmarks/x.py` at commit `sha`) is history
    text = re.sub(r"`benchmarks/[a-z_0-9]+\.py` at commit", "", doc.read_text())
    scripts = set(re.findall(r"(?<![\w:])benchmarks/([a-z_0-9]+)\.py", text))
    assert scripts <= SCRIPTS, sorted(scripts - SCRIPTS)
    parser = build_parser()
    bench = next(a for a in parser._subparsers._group_actions[0].choices["bench"]._actions
                 if a.dest == "bench_command")
    subs = set(re.findall(r"\bpensieve bench ([a-z][a-z-]*)", text))
    assert subs <= set(bench.choices), sorted(subs - set(bench.choices))
