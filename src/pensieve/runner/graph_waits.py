"""Per-group swap-in waits inside captured CUDA graphs.

A captured graph cannot wait on the swapper's events, which are new each step: without these
waits a step with prefill replayed from a mixed-step graph waits for *every* layer's swap-ins
before its first layer, and a step with many swap-ins is better run eagerly (layer-pipelined,
but paying the host time of issuing an eager forward: docs/performance_history.md, "Steps with
swap-ins: inputs first, graphs that wait per group").

:class:`GraphLayerWaits` gives the mixed-step graphs one fixed *external* CUDA event per
group of layers (``torch.cuda.Event(external=True)``): a wait on it during capture becomes an
event-wait node of the graph, which at replay waits for the event's last record before the
launch. Before a replay with swap-ins, :meth:`GraphLayerWaits.arm` re-records each fixed event
once the swapper's event of that group has completed (a side stream waits for the swapper's
event, then records the fixed one), so the graph's layer ``i`` waits for its group's swap-ins
only, as an eager step's does. A step without swap-ins does not arm them: the fixed events
hold records that completed in an earlier step, and the waits cost nothing.

The groups are the swapper's: ``staged`` swap-ins complete by groups of layers
(:func:`~pensieve.runner.swap_staged.layer_groups`), every layer of a group with one event;
the other methods have an event per layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pensieve.runner.swap_staged import layer_groups


def wait_layers(method: str, num_layers: int, in_groups: int) -> list[int]:
    """The layers at which a graph waits: the first of each group of the swapper's swap-in
    events (``staged``: its ``in_groups`` groups; any other method: every layer)."""
    if method == "staged":
        return [a for a, _ in layer_groups(num_layers, in_groups)]
    return list(range(num_layers))


class GraphLayerWaits:
    """Fixed external events, one per wait layer, that captured graphs wait on."""

    def __init__(self, layers: list[int], device: torch.device) -> None:
        self.layers = tuple(layers)
        self._events = {i: torch.cuda.Event(external=True) for i in self.layers}
        self._stream = torch.cuda.Stream(device, priority=-1)
        current = torch.cuda.current_stream(device)
        for event in self._events.values():  # created, and completed: an unrecorded event's
            event.record(current)  # wait would be no wait at all, and capture no node
        current.synchronize()

    def wait(self, layer: int) -> None:
        """``AttentionMetadata.layer_ready`` of a captured forward: the current stream waits
        for the layer's fixed event, if the layer starts a group."""
        event = self._events.get(layer)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def arm(self, layer_ready: Callable[[int], None]) -> None:
        """Re-record every fixed event after the swapper's event of its layer
        (``layer_ready``, :meth:`~pensieve.runner.swapper.KVSwapper.start_step`'s callback),
        in layer order, on a side stream. Call before the replay it is for."""
        with torch.cuda.stream(self._stream):
            for i in self.layers:
                layer_ready(i)  # the side stream waits for the swapper's event of layer i
                self._events[i].record(self._stream)
