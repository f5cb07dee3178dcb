"""``pensieve bench``: the load generator, the workloads and the clients of the systems it
drives (:mod:`pensieve.bench.commands` has the subcommands). Optional dependencies come with the
``bench`` extra (``pip install 'pensieve[bench]'``); :func:`require_extra` imports one and, when
it is missing, says which extra brings it."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(ImportError):
    """An optional dependency of ``pensieve bench`` is not installed (the message names it and
    the extra)."""


def require_extra(module: str, package: str, needed_for: str) -> ModuleType:
    """Import ``module`` (of the distribution ``package``), or raise :class:`MissingExtra`
    naming ``package`` and the ``bench`` extra, and what it is ``needed_for``."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtra(f"{needed_for} needs the optional package {package!r}: "
                           f"pip install 'pensieve[bench]' (or pip install {package})") from e
