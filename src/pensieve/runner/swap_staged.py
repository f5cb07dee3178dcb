"""The ``staged`` method's copies (:mod:`pensieve.runner.swapper`), one object
(:class:`StagedCopies`) that :class:`~pensieve.runner.swapper.KVSwapper` holds: swap-outs
gathered on the GPU into two staging halves then copied to the chunk-major host tier by the
copy engines; staged swap-ins copied by groups of layers into a staging buffer, then scattered
into the GPU caches (by groups of layers: in two halves, each piece's copies overlapping the
previous piece's scatter). Swap-outs go by groups of layers too (:data:`DEFAULT_OUT_GROUPS`):
each group's gather, then its copies to the host, so the copy engines start after a group's
gather rather than the whole piece's. The copies between the staging buffers and the host go
in one call a piece (and group) (:class:`~pensieve.runner.copy_engine.CopyEngine`); the
gathers and scatters are the swap kernel's launches
(:class:`~pensieve.runner.swap_copies.SwapKernels`). Also here: how the tunable paths are
chosen (:func:`in_groups_of`, :func:`ahead_waits_of`)."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pensieve.runner.copy_engine import CopyEngine, pieces, run_pieces
from pensieve.runner.swap_streams import Streams, runs_of

if TYPE_CHECKING:
    from pensieve.engine.kv_layout import KVLayout
    from pensieve.runner.swap_copies import SwapKernels

DEFAULT_IN_GROUPS = 8
"""Staged: groups of layers the swap-ins are copied by (layer i waits for its group only)."""


DEFAULT_OUT_GROUPS = 8
"""Staged: groups of layers the background swap-outs are gathered and copied by."""


def groups_of(value: int | None, name: str, default: int, num_layers: int) -> int:
    """Groups of layers of a staged copy path: ``value``, else ``default``; at most one per
    layer; raises on a count below 1."""
    if value is None:
        value = default
    if value < 1:
        raise ValueError(f"{name} {value} < 1")
    return min(value, num_layers)


def layer_groups(num_layers: int, groups: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``min(groups, num_layers)`` groups of consecutive layers, as even
    as they come."""
    g = max(1, min(groups, num_layers))
    edges = [round(i * num_layers / g) for i in range(g + 1)]
    return list(zip(edges[:-1], edges[1:], strict=True))


def in_groups_of(in_groups: int | None, num_layers: int) -> int:
    """Groups of layers of the staged swap-ins: ``in_groups``, else
    :data:`DEFAULT_IN_GROUPS`; at most one per layer."""
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


class StagedCopies:
    """The staging buffers and the copies through them, between the GPU caches (through
    ``kernels``, the swap kernel's launches) and ``host``, the chunk-major host tier
    (``[num_cpu_blocks, L, 2, C, Hkv, D]``), through the copy engines.

    ``layout``: the engine's KV layout (the chunk's shape, dtype and bytes: the swapper's).
    ``staging_chunks``: chunks per staging piece and half (the device staging memory is at
    most 2 x this (out) + this (in) chunks of all layers). ``out_groups``: the groups of layers
    background swap-outs are gathered and copied to the host by (at most one per layer; may be
    changed between steps). ``num_copies``: host<->device copies issued (per run, or per chunk
    per group of layers)."""

    def __init__(self, kernels: SwapKernels, host: torch.Tensor, layout: KVLayout,
                 staging_chunks: int, out_groups: int | None = None) -> None:
        self.kernels = kernels
        self.host = host
        self.num_layers = layout.num_layers
        self.block_shape = layout.block_shape  # (chunk_size, num_kv_heads, head_dim)
        self.layer_bytes = layout.layer_bytes
        """Bytes of K and V of one block in one layer."""
        self.chunk_bytes = layout.block_bytes
        """Bytes of one chunk of every layer (a row of the chunk-major tiers)."""
        self.dtype, self.device = layout.dtype, kernels.gpu_caches[0].device
        self.staging_chunks = staging_chunks
        self.out_groups = groups_of(out_groups, "out_groups", DEFAULT_OUT_GROUPS,
                                    self.num_layers)
        self.out_stage: list[torch.Tensor] = []
        """The two ``[rows, L, 2, C, Hkv, D]`` device staging halves of the swap-outs
        (rows <= staging_chunks; grown on demand)."""
        self.half_free: list[Any] = [None, None]
        """Event after the last copy out of each half (None: free)."""
        self.next_half = 0
        self.in_stage: torch.Tensor | None = None
        """The ``[rows, L, 2, C, Hkv, D]`` device staging buffer of the swap-ins."""
        self.engine = CopyEngine(self.device)
        """The copies between the staging buffers and the host tier."""
        self.num_copies = 0

    def in_spans(self) -> list[tuple[int, int, Any]]:
        """The scatter launches from the whole in-staging buffer (all layers)."""
        assert self.in_stage is not None
        return self.kernels.spans(("in", True), self.in_stage.permute(1, 2, 0, 3, 4, 5), True,
                                  0, self.num_layers)

    def out_spans(self, h: int) -> list[tuple[int, int, Any]]:
        """The gather launches into the whole out-staging half ``h`` (all layers)."""
        return self.kernels.spans((f"out{h}", False),
                                  self.out_stage[h].permute(1, 2, 0, 3, 4, 5), False, 0,
                                  self.num_layers)

    def grow_out(self, rows: int) -> None:
        """Out-staging halves of at least ``rows`` rows. Replaced halves stay referenced by
        the batches still using them; the new ones are free."""
        if self.out_stage and self.out_stage[0].shape[0] >= rows:
            return
        shape = (rows, self.num_layers, 2, *self.block_shape)
        with torch.inference_mode(False):  # written outside inference mode too (simulator)
            self.out_stage = [torch.empty(shape, dtype=self.dtype, device=self.device)
                              for _ in range(2)]
        self.half_free = [None, None]
        self.kernels.forget("out0", "out1")

    def grow_in(self, rows: int) -> None:
        if self.in_stage is not None and self.in_stage.shape[0] >= rows:
            return
        with torch.inference_mode(False):
            self.in_stage = torch.empty((rows, self.num_layers, 2, *self.block_shape),
                                        dtype=self.dtype, device=self.device)
        self.kernels.forget("in")

    def _dma_rows(self, stage: torch.Tensor, runs: list[tuple[int, int, int]],
                  to_host: bool) -> None:
        """Copy the runs ``(stage row, CPU block, length)`` between ``stage`` and the host
        tier (both chunk-major: one contiguous piece per run), on the current stream, in one
        call to the copy engines."""
        descs = run_pieces(stage.data_ptr(), self.host.data_ptr(), runs, self.chunk_bytes,
                           to_host)
        self.engine.copy(*descs, to_device=not to_host)
        self.num_copies += len(runs)

    def _dma_group(self, stage: torch.Tensor, cpu: np.ndarray, start: int, stop: int) -> None:
        """Copy layers ``[start, stop)`` of the CPU blocks ``cpu`` into rows ``0 ..
        len(cpu) - 1`` of ``stage`` packed by group (row j: those layers of one chunk, at
        ``j * (stop - start)`` layers), one copy per chunk, one call (all layers: one copy per
        run of consecutive CPU blocks)."""
        if start == 0 and stop == self.num_layers:
            self._dma_rows(stage, runs_of(cpu.tolist()), False)
            return
        lb = self.layer_bytes
        descs = pieces(stage.data_ptr(), np.arange(len(cpu), dtype=np.uint64),
                       (stop - start) * lb, self.host.data_ptr() + start * lb, cpu,
                       self.chunk_bytes, (stop - start) * lb)
        self.engine.copy(*descs, to_device=True)
        self.num_copies += len(cpu)

    def _in_view(self, first: int, end: int, rows: int, half: int = 0, halves: int = 1
                 ) -> Any:
        """``[end - first, 2, rows, C, Hkv, D]`` view of the in-staging buffer (of its half
        ``half`` when cut in ``halves`` = 2) packed by the group of layers ``[first, end)``."""
        return self._packed(self._in_flat(half, halves), rows, end - first)

    def _in_flat(self, half: int, halves: int) -> torch.Tensor:
        """The in-staging buffer flat, or its half ``half`` when cut in ``halves`` = 2."""
        stage = self.in_stage
        assert stage is not None
        size = stage.numel() // halves
        return stage.view(-1)[half * size:(half + 1) * size]

    def _wait_half_free(self, st: Streams, stream: Any, h: int) -> None:
        """``stream`` waits until the copies out of half ``h`` issued so far are done."""
        if self.half_free[h] is not None:
            st.wait(stream, self.half_free[h])

    def issue_out(self, st: Streams, pairs: list[tuple[int, int]], gather: Any,
                          dma: Any) -> tuple[Any, list[Any]]:
        """Issue the swap-outs ``pairs`` (gpu, cpu) as gathers on ``gather`` into the staging
        halves and copies to the host on ``dma``, at most :attr:`staging_chunks` per piece;
        by :attr:`out_groups` groups of layers, each group's copies following its own
        gather (a half packed by group, as :meth:`_in_view`). Returns the event after the
        last copy and what must stay referenced until then."""
        size = self.staging_chunks
        order = sorted(pairs, key=lambda p: p[1])
        self.grow_out(min(len(order), size))
        rows = self.out_stage[0].shape[0]
        idx = st.upload(gather, [(g, j % rows) for j, (g, _) in enumerate(order)])
        refs: list[Any] = [idx, *self.out_stage]
        groups = layer_groups(self.num_layers, self.out_groups)
        event = None
        for k in range(0, len(order), rows):
            piece = order[k:k + rows]
            h, self.next_half = self.next_half, self.next_half ^ 1
            self._wait_half_free(st, gather, h)
            pairs_k = idx[k:k + len(piece)]
            if len(groups) == 1:
                st.run(gather, functools.partial(self.kernels.launch, self.out_spans(h), pairs_k,
                                                 0, self.num_layers))
                st.wait(dma, st.record(gather))
                runs = runs_of([c for _, c in piece])
                st.run(dma, functools.partial(self._dma_rows, self.out_stage[h], runs, True))
            else:
                cpu = np.fromiter((c for _, c in piece), dtype=np.uint64, count=len(piece))
                for a, b in groups:
                    spans = self._out_group_spans(h, a, b, rows)
                    st.run(gather, functools.partial(self._gather, spans, pairs_k))
                    st.wait(dma, st.record(gather))
                    st.run(dma, functools.partial(self._dma_out_group, h, rows, cpu, a, b))
            event = self.half_free[h] = st.record(dma)
        return event, refs

    def _out_group_spans(self, h: int, a: int, b: int, rows: int) -> list[tuple[int, int, Any]]:
        """Gather launches of layers ``[a, b)`` into out-staging half ``h`` packed by group:
        the group's ``[rows, b - a, 2, C, Hkv, D]`` block starts ``rows * a`` layers of a
        chunk into the half."""
        key = (f"out{h}", a, b, rows)
        spans = self.kernels.launches.get(key)
        if spans is None:
            flat = self.out_stage[h].view(-1)[rows * a * 2 * math.prod(self.block_shape):]
            spans = self.kernels.spans(key, self._packed(flat, rows, b - a), False, a, b)
        return spans

    def _packed(self, flat: torch.Tensor, rows: int, layers: int) -> Any:
        """``[layers, 2, rows, C, Hkv, D]`` view of the start of ``flat`` holding ``rows``
        chunks of ``layers`` layers each, chunk-major (a staging buffer packed by group)."""
        n = rows * layers * 2 * math.prod(self.block_shape)
        return flat[:n].view(rows, layers, 2, *self.block_shape).permute(1, 2, 0, 3, 4, 5)

    def _dma_out_group(self, h: int, rows: int, cpu: np.ndarray, a: int, b: int) -> None:
        """Copy layers ``[a, b)`` of the first ``len(cpu)`` rows of out-staging half ``h``
        (packed by group, :meth:`_out_group_spans`) to the CPU blocks ``cpu``: one copy per
        chunk, one call."""
        lb = self.layer_bytes
        stage = self.out_stage[h].data_ptr() + rows * a * lb
        descs = pieces(self.host.data_ptr() + a * lb, cpu, self.chunk_bytes, stage,
                       np.arange(len(cpu), dtype=np.uint64), (b - a) * lb, (b - a) * lb)
        self.engine.copy(*descs, to_device=False)
        self.num_copies += len(cpu)

    def issue_in(self, st: Streams, stream: Any, pairs: list[tuple[int, int]],
                         groups: int = 1) -> tuple[list[Any], list[Any]]:
        """Issue the swap-ins ``pairs`` (cpu, gpu) by ``groups`` groups of layers: per group,
        per piece of as many chunks as the in-staging buffer holds of the group's layers
        (:attr:`staging_chunks` chunks of all layers), the copies of those layers of each
        chunk into the buffer (one call), then a scatter of them into the GPU caches on
        ``stream``. By groups (``groups`` > 1), the buffer is cut in two halves used in turn
        and the copies run on the in-copy stream (``Streams.in_dma_stream``), so that a
        piece's copies overlap the previous piece's scatter: a piece's copies wait for the
        scatter out of the half two pieces back; each scatter waits for its copies. All
        layers at once (the default; ``swap_in_ahead``): one buffer, everything on
        ``stream``. Returns what must stay referenced until the stream's work is done, and
        one event per layer (after its group's last scatter, on ``stream``)."""
        size, layers = self.staging_chunks, self.num_layers
        order = sorted(pairs, key=lambda p: p[0])
        self.grow_in(min(len(order), size))
        stage = self.in_stage
        assert stage is not None
        cpu = np.fromiter((c for c, _ in order), dtype=np.uint64, count=len(order))
        idx: dict[int, torch.Tensor] = {}  # chunks a piece -> (row, gpu block) pairs
        events: list[Any] = []
        dma = st.in_dma_stream
        free: list[Any] = [None, None]  # event after the last scatter out of each half
        flats: list[torch.Tensor] = []  # the two halves, flat
        if groups > 1:  # the copies follow what the in stream waited for and ran so far
            st.wait(dma, st.record(stream))
        piece = 0
        for a, b in layer_groups(layers, groups):
            cap = stage.shape[0] * layers // (b - a)  # chunks the whole buffer holds
            halves = 2 if b - a < layers and cap >= 2 else 1
            rows = cap // halves  # chunks a piece
            if rows not in idx:
                idx[rows] = st.upload(stream, [(j % rows, g) for j, (_, g) in enumerate(order)])
            if halves == 1:
                spans = (self.in_spans() if b - a == layers else self.kernels.spans(
                    ("in", a, b, rows), self._in_view(a, b, rows), True, a, b))
            last = None  # the group's last scatter's event, if recorded for a half
            for k in range(0, len(order), rows):
                m = min(rows, len(order) - k)
                if halves == 1:
                    st.run(stream, functools.partial(self._dma_group, stage, cpu[k:k + m], a,
                                                     b))
                    st.run(stream, functools.partial(self._scatter, spans, idx[rows][k:k + m]))
                    if groups > 1:  # the whole buffer was used: both halves after this
                        free = [st.record(stream)] * 2
                        st.wait(dma, free[0])
                        last = free[0]
                    continue
                h, piece = piece % 2, piece + 1
                key = ("in", a, b, rows, h)
                spans = self.kernels.launches.get(key) or self.kernels.spans(
                    key, self._in_view(a, b, rows, h, 2), True, a, b)
                if not flats:
                    flats = [self._in_flat(0, 2), self._in_flat(1, 2)]
                self._wait_in_half(st, dma, free[h])
                st.run(dma, functools.partial(self._dma_group, flats[h], cpu[k:k + m], a, b))
                st.wait(stream, st.record(dma))
                st.run(stream, functools.partial(self._scatter, spans, idx[rows][k:k + m]))
                free[h] = last = st.record(stream)
            events += [last if last is not None else st.record(stream)] * (b - a)
        return [*idx.values(), stage], events

    @staticmethod
    def _wait_in_half(st: Streams, dma: Any, free: Any) -> None:
        """The in-copy stream waits for ``free``, the scatter out of the half it copies into
        next (None: not used yet in this call)."""
        if free is not None:
            st.wait(dma, free)

    def _scatter(self, spans: list[tuple[int, int, Any]], pairs: torch.Tensor) -> None:
        self.kernels.run_all(spans, pairs)

    def _gather(self, spans: list[tuple[int, int, Any]], pairs: torch.Tensor) -> None:
        """The launches ``spans`` (a swap-out group's gather into its staging half)."""
        self._scatter(spans, pairs)
