"""Ordering and streams of the swapper's copies (:mod:`pensieve.runner.swapper`).

CUDA, staged method: copy streams and the compute (current) stream.

- The *in* stream (high priority) runs ``swap_out_first`` (one kernel launch, all layers),
  then the swap-ins by groups of layers: copies from the host tier into the in-staging buffer
  on the *in-dma* stream, into the two halves of the buffer in turn, and the scatters into
  the GPU caches on the in stream. The in-dma stream first waits for the in stream's work so
  far (an event), each scatter for its copies, each piece's copies for the scatter out of the
  same half two pieces back. One event per layer, after its group's last scatter:
  ``layer_ready(i)`` makes the compute stream wait for layer i's event (which follows every
  ``swap_out_first`` copy too), so layer i's attention sees its swapped-in KV and never writes
  a block before its old content is copied out.
- Then ``swap_in_ahead``: the step's compute does not wait for it. With
  ``ahead_waits="layers"`` (the default) the ahead copies go by groups of layers as the
  step's swap-ins do, the next step's layer i waits for its group's event (the step's own
  swap-ins, later on the in stream, cover them), and the out stream waits for the last ahead
  event itself; with ``"all"`` they go in one piece (copies and scatter on the in stream)
  and the next step's ``start_step`` makes the compute stream wait for their event before
  anything else (and so, through the event recorded on the compute stream, both copy
  streams' next work).
- The *out* stream runs the background ``swap_out``'s gathers into the staging halves and
  the *dma* stream the device-to-host copies, each piece's copies after its gather (an
  event), each gather into a half after the copies of the piece that used that half before
  (the half's "free" event, kept across batches and steps), concurrently with the in stream
  (PCIe is full duplex). It is not waited for at the end of the step: each such batch joins
  a FIFO of batches in flight (its event, its index tensor and staging halves, the CPU blocks
  it writes, the GPU blocks it reads). The batch's event is recorded on the dma stream after
  its last copy: it covers the batch's gathers, and every older batch (one dma stream), so
  the batches complete in plan order.
- Both copy streams first wait for an event recorded on the compute stream in
  :meth:`~KVSwapper.start_step`: no copy reads a block before the compute stream's earlier
  writes to it are done, nor overwrites one it may still read.
- Hazards across streams and steps (:func:`step_waits`, a pure function): the in stream waits
  for the newest in-flight batch that writes a CPU block the in stream reads (a swap-in of a
  chunk still being swapped out) or writes (``swap_out_first`` into a CPU block freed and
  reused), or that reads a GPU block a swap-in overwrites; the out stream waits for the in
  stream's work of the step when its ``swap_out`` writes a CPU block the step's swap-ins read
  or its ``swap_out_first`` writes, or reads a GPU block a swap-in writes (the plan order).
- :meth:`~KVSwapper.end_step` waits for the step's in-stream work only (the compute stream's
  sync has normally covered it already) and returns how many background batches are still in
  flight (completed ones are popped from the front with ``Event.query``).
  :meth:`~KVSwapper.finish_step` waits for everything.

The ordering (:func:`step_waits`) is a pure function of the plan and the batches in flight;
:class:`Streams` is what the staged method issues its work through
(:class:`CudaStreams` on CUDA, :data:`IMMEDIATE` for the synchronous CPU path, a simulator in
the tests).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from pensieve.core.copy_order import copy_waits
from pensieve.core.outputs import SwapPlan

_T = TypeVar("_T")

# ---------------------------------------------------------------------- ordering (pure)


@dataclass(frozen=True)
class InFlight:
    """What a background swap-out batch still in flight touches."""

    cpu_writes: frozenset[int]
    gpu_reads: frozenset[int]


@dataclass(frozen=True)
class StepWaits:
    """Cross-stream waits one step needs (see the module docstring)."""

    in_after: int
    """Index in the in-flight FIFO of the newest batch the in stream must wait for (its event
    covers every older batch: one stream), or -1."""
    out_after_in: bool
    """Whether the out stream waits for the step's in-stream work before its swap-outs."""


def step_waits(plan: SwapPlan, in_flight: Sequence[InFlight]) -> StepWaits:
    """The waits that order ``plan``'s copies after ``in_flight`` (oldest first) and its
    background swap-outs after its own urgent copies and swap-ins, where they touch the same
    blocks (the plan order of the module docstring)."""
    return StepWaits(*copy_waits(plan, in_flight))


def pop_completed(fifo: deque[Any], done: Callable[[Any], bool]) -> int:
    """Pop the completed batches from the front of ``fifo`` (they complete in order); returns
    how many remain."""
    while fifo and done(fifo[0]):
        fifo.popleft()
    return len(fifo)


# ---------------------------------------------------------------------- streams


class Streams(Protocol):
    """The stream operations of the kernel method (``None`` = the current, compute stream).
    :class:`CudaStreams` on CUDA; the tests substitute a simulator that runs enqueued work in
    any order the waits allow."""

    in_stream: Any
    out_stream: Any
    dma_stream: Any
    """The device-to-host copies of staged swap-outs."""
    in_dma_stream: Any
    """``staged``: the host-to-device copies of swap-ins by groups of layers."""

    def record(self, stream: Any) -> Any:
        """Record and return a new event on ``stream``."""

    def wait(self, stream: Any, event: Any) -> None:
        """Make ``stream``'s later work wait for ``event``."""

    def upload(self, stream: Any, pairs: list[tuple[int, int]]) -> torch.Tensor:
        """``[n, 2]`` int64 tensor of ``pairs`` usable by ``stream``'s later work."""

    def run(self, stream: Any, fn: Callable[[], None]) -> None:
        """Enqueue the device work ``fn`` issues on ``stream``."""

    def query(self, event: Any) -> bool:
        """Whether ``event`` has completed (does not block)."""

    def synchronize(self, event: Any) -> None:
        """Block the host until ``event`` has completed."""


class CudaStreams:
    """:class:`Streams` on a CUDA device: a high-priority in stream, a normal out stream.

    A step with swap-ins switches streams many times on the host: :meth:`run` sets and restores
    the current stream itself, on a device with an explicit index, where
    ``torch.cuda.stream(...)`` and ``torch.cuda.current_stream()`` look the current device up
    through several Python calls each time (a large share of the host time of issuing a
    step's staged swap-ins: docs/performance_history.md, "Host time of steps with prefill, and what
    the server's step log shows", "Phase by phase")."""

    def __init__(self, device: torch.device) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self._index = index
        # High priority: swap-ins are on the step's critical path.
        self.in_stream = torch.cuda.Stream(self.device, priority=-1)
        self.out_stream = torch.cuda.Stream(self.device)
        self.dma_stream = torch.cuda.Stream(self.device)
        self.in_dma_stream = torch.cuda.Stream(self.device, priority=-1)

    def _s(self, stream: torch.cuda.Stream | None) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device) if stream is None else stream

    def record(self, stream: torch.cuda.Stream | None) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self._s(stream))
        return event

    def wait(self, stream: torch.cuda.Stream | None, event: torch.cuda.Event) -> None:
        self._s(stream).wait_event(event)

    def upload(self, stream: torch.cuda.Stream, pairs: list[tuple[int, int]]) -> torch.Tensor:
        host = torch.tensor(pairs, dtype=torch.int64, pin_memory=True)
        # allocated for, and copied on, that stream
        return self._on(stream, lambda: host.to(self.device, non_blocking=True))

    def run(self, stream: torch.cuda.Stream, fn: Callable[[], None]) -> None:
        self._on(stream, fn)

    def _on(self, stream: torch.cuda.Stream, fn: Callable[[], _T]) -> _T:
        """``fn()`` with ``stream`` current, then the stream before it again."""
        if torch.cuda.current_device() != self._index:  # let torch switch the device too
            with torch.cuda.stream(stream):
                return fn()
        prev = torch.cuda.current_stream(self.device)
        torch.cuda.set_stream(stream)
        try:
            return fn()
        finally:
            torch.cuda.set_stream(prev)

    def query(self, event: torch.cuda.Event) -> bool:
        return event.query()

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()


class Immediate:
    """:class:`Streams` that run every operation at once (the synchronous path: the staged
    methods' staging logic on the CPU)."""

    in_stream = out_stream = dma_stream = in_dma_stream = None

    def record(self, stream: Any) -> None:
        return None

    def wait(self, stream: Any, event: Any) -> None:
        pass

    def upload(self, stream: Any, pairs: list[tuple[int, int]]) -> torch.Tensor:
        return torch.tensor(pairs, dtype=torch.int64).view(-1, 2)

    def run(self, stream: Any, fn: Callable[[], None]) -> None:
        fn()

    def query(self, event: Any) -> bool:
        return True

    def synchronize(self, event: Any) -> None:
        pass


IMMEDIATE = Immediate()


def layer_waits(st: Streams, lists: list[list[Any]], check: Callable[[int], None]
                ) -> Callable[[int], None]:
    """``layer_ready``: ``check(i)``, then the current stream waits for layer i's event of
    each list."""
    def layer_ready(i: int) -> None:
        check(i)
        for events in lists:
            st.wait(None, events[i])

    return layer_ready


def runs_of(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive values in ``ids`` (in list order): ``(first index, first
    id, length)`` each."""
    out: list[tuple[int, int, int]] = []
    for j, c in enumerate(ids):
        if out and c == out[-1][1] + out[-1][2] and j == out[-1][0] + out[-1][2]:
            row, first, n = out[-1]
            out[-1] = (row, first, n + 1)
        else:
            out.append((j, c, 1))
    return out


@dataclass
class OutBatch:
    """A background swap-out batch in flight (kernel streams)."""

    event: Any
    refs: Any
    """What its work uses and must stay allocated until ``event``: the index tensor, and the
    staging halves (staged)."""
    touches: InFlight
