"""How the swapper's optional copy paths are chosen: swap-ins ahead through the kernel or the
copy engines, and how the next step waits for them; urgent swap-outs at once or layer by
layer; staged swap-ins by how many groups of layers (:mod:`pensieve.runner.swapper`), from the
constructor's argument or, given None, the environment where the path applies."""

from __future__ import annotations

import os

from pensieve.envs import env_flag
from pensieve.runner.swap_copies import CHUNK_MAJOR, STREAM_METHODS
from pensieve.runner.swap_staged import DEFAULT_IN_GROUPS, groups_of

AHEAD_PATHS = ("kernel", "dma")
"""Ways ``swap_in_ahead`` copies may run on streams (:class:`KVSwapper` ``ahead``)."""


def ahead_path(ahead: str | None, method: str) -> str:
    """How ``swap_in_ahead`` copies run: ``ahead``, else ``PENSIEVE_SWAP_AHEAD`` where it
    applies (``dma`` needs a chunk-major method), else ``"kernel"``."""
    chosen = ahead or os.environ.get("PENSIEVE_SWAP_AHEAD") or "kernel"
    if chosen not in AHEAD_PATHS:
        raise ValueError(f"swap-ins ahead {chosen!r} not in {AHEAD_PATHS}")
    if chosen == "dma" and method not in CHUNK_MAJOR:
        if ahead is not None:
            raise ValueError(f"swap-ins ahead 'dma' needs a chunk-major method {CHUNK_MAJOR}, "
                             f"not {method!r}")
        return "kernel"  # the environment's choice, where it applies
    return chosen


def urgent_path(layered: bool | None, method: str) -> bool:
    """Whether urgent swap-outs go layer by layer: ``layered``, else
    ``PENSIEVE_URGENT_LAYERED=1`` where it applies (not ``staged``, whose swap-ins go by
    groups of layers through the copy engines; not ``dma``, which has no streams)."""
    applies = method in STREAM_METHODS and method != "staged"
    if layered is None:
        return env_flag("PENSIEVE_URGENT_LAYERED") and applies  # read (checked) everywhere
    if layered and not applies:
        raise ValueError(f"layered urgent swap-outs need the kernel or hybrid method, "
                         f"not {method!r}")
    return layered


def in_groups_of(in_groups: int | None, num_layers: int) -> int:
    """Groups of layers of the staged swap-ins: ``in_groups``, else ``PENSIEVE_SWAP_IN_GROUPS``,
    else :data:`~pensieve.runner.swap_staged.DEFAULT_IN_GROUPS`; at most one per layer."""
    return groups_of(in_groups, "in_groups", "PENSIEVE_SWAP_IN_GROUPS", DEFAULT_IN_GROUPS,
                     num_layers)


AHEAD_WAITS = ("all", "layers")
"""How a step's compute waits for the previous step's ``swap_in_ahead`` copies
(:class:`KVSwapper` ``ahead_waits``)."""


def ahead_waits_of(waits: str | None, method: str, ahead: str) -> str:
    """``"all"``: the step's compute waits for every ahead copy before anything else;
    ``"layers"``: the ahead copies go by the staged swap-ins' groups of layers, and each layer
    of the next step waits for its group only (as for the step's own swap-ins), so the step
    starts while the tail of the copies still runs. ``layers`` needs the ahead copies through
    the copy engines (``staged``, or ``ahead="dma"``). ``waits``, else
    ``PENSIEVE_AHEAD_WAITS``, else ``"layers"``, each where it applies, else ``"all"``."""
    applies = method in STREAM_METHODS and (method == "staged" or ahead == "dma")
    chosen = waits or os.environ.get("PENSIEVE_AHEAD_WAITS") or (
        "layers" if applies else "all")
    if chosen not in AHEAD_WAITS:
        raise ValueError(f"ahead waits {chosen!r} not in {AHEAD_WAITS}")
    if chosen == "layers" and not applies:
        if waits is not None:
            raise ValueError("ahead waits 'layers' need the ahead copies through the copy "
                             f"engines (method 'staged' or ahead 'dma'), not {method!r} / "
                             f"{ahead!r}")
        return "all"  # the environment's choice, where it applies
    return chosen
