"""The docs name only what the code defines.

Every ``PENSIEVE_*`` environment name and every ``--flag`` in ``README.md``, ``docs/*.md`` and
``benchmarks/README.md`` must be one the code reads or declares: a string in the Python code of
``src/``, ``benchmarks/``, ``scripts/`` or ``tests/`` (not a comment or docstring), a name or
flag on a command line of the shell scripts there, or an option of the command-line parsers
(which also declare the engine's options generated from the config); a flag of another program
counts when the code passes it too (``pip install --no-deps``). Not checked: the history files
(``docs/*_history.md``), records of runs with their commands as run at the commits they name,
and in the other docs an inline code span that runs a file at a commit (``python
361390a:benchmarks/x.py --flag``: that commit's options).
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE_ROOTS = ("src", "benchmarks", "scripts", "tests")
ENV = re.compile(r"\bPENSIEVE_[A-Z0-9_]*[A-Z0-9]\b")
FLAG = re.compile(r"(?<![\w./-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*\b")
PINNED_SPAN = re.compile(r"`[^`\n]*\b[0-9a-f]{7,40}:[\w./-]+[^`]*`")
"""An inline code span that names a file at a commit."""


def docs() -> list[Path]:
    """The docs that describe the current code (history files left out)."""
    out = [ROOT / "README.md", ROOT / "benchmarks" / "README.md"]
    out += sorted(p for p in (ROOT / "docs").glob("*.md") if not p.stem.endswith("_history"))
    return out


def _python_strings(text: str) -> list[str]:
    """The string constants of a module, docstrings left out."""
    tree = ast.parse(text)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef
                                | ast.AsyncFunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings]


def _shell_lines(text: str) -> list[str]:
    """The lines of a shell script with comments cut off (a ``#`` after a blank)."""
    return [re.split(r"(?:^|\s)#", line, maxsplit=1)[0] for line in text.splitlines()]


def _parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    out: set[str] = set()
    for action in parser._actions:
        out |= {s for s in action.option_strings if s.startswith("--")}
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _parser_flags(sub)
    return out


def defined() -> tuple[set[str], set[str]]:
    """``(environment names, flags)`` the code reads or declares."""
    texts: list[str] = []
    for root in CODE_ROOTS:
        for path in sorted((ROOT / root).rglob("*")):
            if path == Path(__file__).resolve():  # its examples of unknown names
                continue
            if path.suffix == ".py":
                texts += _python_strings(path.read_text())
            elif path.suffix == ".sh":
                texts += _shell_lines(path.read_text())
    names = {m for t in texts for m in ENV.findall(t)}
    flags = {m for t in texts for m in FLAG.findall(t)}
    from pensieve.cli import build_parser
    from pensieve.options import add_engine_args

    engine = argparse.ArgumentParser()
    add_engine_args(engine)
    flags |= _parser_flags(build_parser()) | _parser_flags(engine)
    return names, flags


def unknown(text: str, names: set[str], flags: set[str]) -> list[str]:
    """The environment names and flags of ``text`` not in ``names`` / ``flags``, in order of
    first appearance (inline code spans that name a file at a commit left out)."""
    text = PINNED_SPAN.sub("", text)
    seen = dict.fromkeys(ENV.findall(text) + FLAG.findall(text))
    return [w for w in seen if w not in names and w not in flags]


@pytest.fixture(scope="module")
def known() -> tuple[set[str], set[str]]:
    return defined()


def test_the_checker_finds_what_the_code_does_not_define(known: tuple[set[str], set[str]]
                                                         ) -> None:
    names, flags = known
    assert {"PENSIEVE_STEP_LOG", "PENSIEVE_API_KEYS"} <= names  # read by the server
    assert {"--gpu-kv-gb", "--engine", "--sessions", "--share-prefixes"} <= flags
    assert "PENSIEVE_FUSED_OPS" not in names  # removed; only the history names it
    text = ("Set `PENSIEVE_FUSED_OPS=0` and run `pensieve serve --gpu-kv-gb 4 --fused-ops`;\n"
            "`PENSIEVE_STEP_LOG=x pip install --no-deps .` (not `--no-deps-at-all`);\n"
            "`python 361390a:benchmarks/a.py --labels a` but `python benchmarks/a.py --labels`")
    assert unknown(text, names, flags) == ["PENSIEVE_FUSED_OPS", "--fused-ops",
                                           "--no-deps-at-all", "--labels"]


@pytest.mark.parametrize("doc", docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_name_only_what_the_code_defines(doc: Path,
                                              known: tuple[set[str], set[str]]) -> None:
    names, flags = known
    assert unknown(doc.read_text(), names, flags) == []
