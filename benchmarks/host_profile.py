"""cProfile of a host call repeated from an idle device (the benchmarks' ``--profile``)."""

from __future__ import annotations

import cProfile
import io
import pstats
from collections.abc import Callable

import torch


def profile_calls(call: Callable[[], object], steps: int, sort: str = "tottime",
                  top: int = 30, after: Callable[[], object] | None = None) -> str:
    """cProfile of ``steps`` calls of ``call``, each after a device synchronize (and followed,
    unprofiled, by ``after``), sorted by ``sort``, the ``top`` functions: driver calls
    included."""
    prof = cProfile.Profile()
    for _ in range(steps):
        torch.cuda.synchronize()
        prof.enable()
        call()
        prof.disable()
        if after is not None:
            after()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(sort).print_stats(top)
    return buf.getvalue()
