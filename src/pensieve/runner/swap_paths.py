"""How the swapper's optional copy paths are chosen: swap-ins ahead through the kernel or the
copy engines, and how the next step waits for them; urgent swap-outs at once or layer by
layer; staged swap-ins by how many groups of layers (:mod:`pensieve.runner.swapper`), from the
constructor's argument or, given None, the measured default where the path applies."""

from __future__ import annotations

from pensieve.runner.swap_copies import CHUNK_MAJOR, STREAM_METHODS
from pensieve.runner.swap_staged import DEFAULT_IN_GROUPS, groups_of

AHEAD_PATHS = ("kernel", "dma")
"""Ways ``swap_in_ahead`` copies may run on streams (:class:`KVSwapper` ``ahead``)."""


def ahead_path(ahead: str | None, method: str) -> str:
    """How ``swap_in_ahead`` copies run: ``ahead``, else ``"kernel"`` (``dma`` needs a
    chunk-major method)."""
    chosen = ahead or "kernel"
    if chosen not in AHEAD_PATHS:
        raise ValueError(f"swap-ins ahead {chosen!r} not in {AHEAD_PATHS}")
    if chosen == "dma" and method not in CHUNK_MAJOR:
        raise ValueError(f"swap-ins ahead 'dma' needs a chunk-major method {CHUNK_MAJOR}, "
                         f"not {method!r}")
    return chosen


def urgent_path(layered: bool | None, method: str) -> bool:
    """Whether urgent swap-outs go layer by layer: ``layered`` (None: no). Applies to the
    kernel and hybrid methods only (not ``staged``, whose swap-ins go by groups of layers
    through the copy engines; not ``dma``, which has no streams)."""
    applies = method in STREAM_METHODS and method != "staged"
    if layered is None:
        return False
    if layered and not applies:
        raise ValueError(f"layered urgent swap-outs need the kernel or hybrid method, "
                         f"not {method!r}")
    return layered


def in_groups_of(in_groups: int | None, num_layers: int) -> int:
    """Groups of layers of the staged swap-ins: ``in_groups``, else
    :data:`~pensieve.runner.swap_staged.DEFAULT_IN_GROUPS`; at most one per layer."""
    return groups_of(in_groups, "in_groups", DEFAULT_IN_GROUPS, num_layers)


AHEAD_WAITS = ("all", "layers")
"""How a step's compute waits for the previous step's ``swap_in_ahead`` copies
(:class:`KVSwapper` ``ahead_waits``)."""


def ahead_waits_of(waits: str | None, method: str, ahead: str) -> str:
    """``"all"``: the step's compute waits for every ahead copy before anything else;
    ``"layers"``: the ahead copies go by the staged swap-ins' groups of layers, and each layer
    of the next step waits for its group only (as for the step's own swap-ins), so the step
    starts while the tail of the copies still runs. ``layers`` needs the ahead copies through
    the copy engines (``staged``, or ``ahead="dma"``). ``waits``, else ``"layers"`` where
    it applies, else ``"all"``."""
    applies = method in STREAM_METHODS and (method == "staged" or ahead == "dma")
    chosen = waits or ("layers" if applies else "all")
    if chosen not in AHEAD_WAITS:
        raise ValueError(f"ahead waits {chosen!r} not in {AHEAD_WAITS}")
    if chosen == "layers" and not applies:
        raise ValueError("ahead waits 'layers' need the ahead copies through the copy "
                         f"engines (method 'staged' or ahead 'dma'), not {method!r} / "
                         f"{ahead!r}")
    return chosen
