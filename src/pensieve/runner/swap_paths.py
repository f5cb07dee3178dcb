"""How the swapper's tunable copy paths are chosen: how the next step waits for the swap-ins
ahead, and by how many groups of layers staged swap-ins go (:mod:`pensieve.runner.swapper`),
from the constructor's argument or, given None, the measured default where the path applies."""

from __future__ import annotations

from pensieve.runner.swap_staged import DEFAULT_IN_GROUPS, groups_of


def in_groups_of(in_groups: int | None, num_layers: int) -> int:
    """Groups of layers of the staged swap-ins: ``in_groups``, else
    :data:`~pensieve.runner.swap_staged.DEFAULT_IN_GROUPS`; at most one per layer."""
    return groups_of(in_groups, "in_groups", DEFAULT_IN_GROUPS, num_layers)


AHEAD_WAITS = ("all", "layers")
"""How a step's compute waits for the previous step's ``swap_in_ahead`` copies
(:class:`KVSwapper` ``ahead_waits``)."""


def ahead_waits_of(waits: str | None, method: str) -> str:
    """``"all"``: the step's compute waits for every ahead copy before anything else;
    ``"layers"``: the ahead copies go by the staged swap-ins' groups of layers, and each layer
    of the next step waits for its group only (as for the step's own swap-ins), so the step
    starts while the tail of the copies still runs. ``layers`` needs the streams of the
    ``staged`` method. ``waits``, else ``"layers"`` where it applies, else ``"all"``."""
    applies = method == "staged"
    chosen = waits or ("layers" if applies else "all")
    if chosen not in AHEAD_WAITS:
        raise ValueError(f"ahead waits {chosen!r} not in {AHEAD_WAITS}")
    if chosen == "layers" and not applies:
        raise ValueError(f"ahead waits 'layers' need the staged method, not {method!r}")
    return chosen
