"""The command line's help as plain text.

The flags' help and the commands' descriptions reuse docstrings, which are written for the
source (reST roles such as ``:mod:`pensieve.core.eviction```, literals in double backticks).
:func:`plain_text` renders them for a terminal, and :class:`PlainHelpFormatter`, set on every
parser of ``pensieve`` by :func:`plain_help`, applies it to each description and help line. A
description shows its first paragraph (a module docstring's summary; the rest is for readers
of the source and the docs).
"""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Iterator
from typing import Any

_ROLE = re.compile(r":[a-z]+:`~?(?:[^`<]*<)?([^`>]*)>?`")
_LITERAL = re.compile(r"``([^`]*)``|`([^`]+)`")


def plain_text(text: str) -> str:
    """``text`` with reST roles reduced to the last part of their target
    (``:func:`pensieve.options.engine_options``` -> ``engine_options``) and literal quotes
    dropped."""
    text = _ROLE.sub(lambda m: m.group(1).rsplit(".", 1)[-1], text)
    return _LITERAL.sub(lambda m: m.group(1) if m.group(1) is not None else m.group(2), text)


def first_paragraph(text: str) -> str:
    """The text up to its first blank line."""
    return re.split(r"\n\s*\n", text.strip(), maxsplit=1)[0]


class PlainHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions keep their line breaks (module docstrings list things); every text is
    rendered by :func:`plain_text`."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain_text(text))

    def _expand_help(self, action: argparse.Action) -> str:
        return plain_text(super()._expand_help(action))


def subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parsers of ``parser``'s subcommands (one level)."""
    return [p for a in parser._actions if isinstance(a, argparse._SubParsersAction)
            for p in dict.fromkeys(a.choices.values())]


def plain_help(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Set :class:`PlainHelpFormatter` on ``parser`` and every subcommand's parser below it,
    and cut their descriptions to the first paragraph; returns ``parser``."""
    parser.formatter_class = PlainHelpFormatter
    if parser.description:
        parser.description = first_paragraph(parser.description)
    for sub in subparsers(parser):
        plain_help(sub)
    return parser


@contextlib.contextmanager
def plain_help_everywhere() -> Iterator[None]:
    """Within: every parser gets :func:`plain_help` when it parses. For the subcommands that
    build a parser of their own when they run (``pensieve bench multiturn`` and the other
    benchmark scripts), whose help would otherwise show their module docstrings as written."""
    original = argparse.ArgumentParser.parse_known_args

    def parse_known_args(self: argparse.ArgumentParser, *args: Any, **kw: Any) -> Any:
        plain_help(self)
        return original(self, *args, **kw)

    argparse.ArgumentParser.parse_known_args = parse_known_args  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_known_args = original  # type: ignore[method-assign]
