"""``pensieve --help`` and every subcommand's help: plain text for a user (no reST markup, no
names from the source), the defaults of the server's own flags, and quick: building the parser
loads neither torch nor the server (that import was the ~5 s of every ``--help``)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import textwrap

import pytest

from pensieve.bench.commands import SCRIPTS
from pensieve.cli import build_parser
from pensieve.help_text import PlainHelpFormatter, plain_text, subparsers

MARKUP = re.compile(r"``|:[a-z]+:`|`[^`\s]+`")
"""reST roles and literals, or a name in backquotes."""
INTERNAL = re.compile(
    r"\b[A-Z][a-z]+[A-Z]\w*\.\w+"  # Class.attribute
    r"|\bpensieve\.[a-z_]+\.[a-z_]+"  # a module path
    r"|\b(?!PENSIEVE_|OMP_)[A-Z][A-Z0-9]*_[A-Z0-9_]+\b")  # a constant (not an env variable)
"""Names from the source: ``SwapPlan.swap_in_ahead``, ``pensieve.core.eviction``,
``DEFAULT_CPU_KV_GB``."""
HEAVY = ("torch", "transformers", "pydantic", "fastapi", "xgrammar", "pensieve.core.scheduler",
         "asyncio")


def _parsers() -> dict[str, argparse.ArgumentParser]:
    out: dict[str, argparse.ArgumentParser] = {}

    def walk(p: argparse.ArgumentParser) -> None:
        out[p.prog] = p
        for sub in subparsers(p):
            walk(sub)

    walk(build_parser())
    return out


def _texts(p: argparse.ArgumentParser) -> list[str]:
    """The description and every flag's help as the formatter renders them (not the usage
    line: metavars such as CHUNK_SIZE are argparse's, not names from the source)."""
    fmt = p._get_formatter()
    assert isinstance(fmt, PlainHelpFormatter), p.prog
    texts = [fmt._format_text(p.description or "")]
    texts += [fmt._expand_help(a) for a in p._actions if a.help and a.help != argparse.SUPPRESS]
    return texts


def test_plain_text_renders_rest():
    assert plain_text("see :func:`~pensieve.options.engine_options` and ``--x``") == \
        "see engine_options and --x"
    assert plain_text(":mod:`pensieve.core.eviction` and `y`") == "eviction and y"


@pytest.mark.parametrize("prog", sorted(_parsers()))
def test_help_is_plain_text_without_internal_names(prog):
    p = _parsers()[prog]
    p.format_help()  # renders
    for text in _texts(p):
        assert not MARKUP.search(text), (prog, text)
        assert not INTERNAL.search(text), (prog, INTERNAL.search(text).group(0), text)


def test_serve_help_states_defaults_and_gguf():
    help_of = {a.dest: " ".join(a.help.split())
               for a in _parsers()["pensieve serve"]._actions if a.help}
    assert "(default: 127.0.0.1" in help_of["host"]
    assert "(default: 8000)" in help_of["port"]
    assert "(default: info)" in help_of["log_level"]
    assert "default: conversations.db in $PENSIEVE_CACHE_DIR" in help_of["store"]
    assert "GGUF" in help_of["load_format"]
    assert "135M" in help_of["model"] or "SmolLM2" in help_of["model"]


def test_bench_entry_is_the_same_without_the_benchmarks_built():
    """``pensieve serve ...`` builds no benchmark parser; the ``bench`` line of ``pensieve
    --help`` reads the same either way."""
    def bench_line(p: argparse.ArgumentParser) -> str:
        (sub,) = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        return next(a.help for a in sub._choices_actions if a.dest == "bench")

    assert bench_line(build_parser("serve")) == bench_line(build_parser())


def test_bench_help_names_every_subcommand():
    bench = _parsers()["pensieve bench"]
    (sub,) = [a for a in bench._actions if isinstance(a, argparse._SubParsersAction)]
    shown = {a.dest: a.help for a in sub._choices_actions}
    assert set(shown) == set(sub.choices) and all(shown.values()), shown
    text = bench.format_help()
    for name in sub.choices:
        assert re.search(rf"^    {re.escape(name)}\b", text, re.M), name


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["generate", "--help"]])
def test_help_imports_neither_torch_nor_the_server(argv):
    """What made ``pensieve --help`` take ~5 s: importing torch, transformers and the server's
    request models to build the parser (and, for all but ``bench``, the benchmarks and the
    scheduler they import). Checked in a fresh interpreter."""
    code = textwrap.dedent(f"""
        import json, sys
        from pensieve.cli import main
        try:
            main({argv!r})
        except SystemExit:
            pass
        print()
        print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert "usage: pensieve" in out
    assert json.loads(out.strip().splitlines()[-1]) == []


def test_plot_without_matplotlib_names_the_extra_before_running(monkeypatch, capsys):
    """The scheduler benchmark's ``--plot`` used to run its benchmark and then crash on the
    import (``benchmarks/scheduler_cost.py`` since the lab left the package)."""
    import scheduler_cost

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    ran = []
    monkeypatch.setattr(scheduler_cost, "run", lambda a: ran.append(a))
    with pytest.raises(SystemExit) as e:
        scheduler_cost.main(["--plot", "x.png"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == ("benchmarks/scheduler_cost.py: error: --plot needs matplotlib, which is "
                   "not installed: pip install 'pensieve[bench]' (or pip install "
                   "matplotlib)"), err
    assert not ran


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_benchmark_scripts_help_is_plain_text(name, capsys):
    """``pensieve bench multiturn --help`` and the others whose parser their module builds:
    rendered through the same plain formatter (their usage lines hold metavars, so only the
    markup and dotted names are looked for here)."""
    from pensieve.cli import main

    try:
        code = main(["bench", name, "--help"])  # a script's exit is its return code
    except SystemExit as e:
        code = e.code
    assert code in (0, None)
    text = capsys.readouterr().out
    assert "usage:" in text
    assert not MARKUP.search(text), MARKUP.search(text).group(0)
    dotted = re.compile(r"\b[A-Z][a-z]+[A-Z]\w*\.\w+|\bpensieve\.[a-z_]+\.[a-z_]+")
    assert not dotted.search(text), dotted.search(text).group(0)
