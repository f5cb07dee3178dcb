"""The CPU tier of the KV cache and the copies between it and the GPU tier.

Owns one pinned host tensor holding, per layer, K then V of every CPU block, in the GPU caches'
dtype; :attr:`KVSwapper.cpu_caches` are its per-layer ``[2, num_cpu_blocks, chunk_size,
num_kv_heads, head_dim]`` views, whatever the layout (:attr:`KVSwapper.host_layout`):
``"layer-major"`` (``[L, 2, num_cpu_blocks, C, Hkv, D]``: method ``dma``) or
``"chunk-major"`` (``[num_cpu_blocks, L, 2, C, Hkv, D]``: one chunk of every layer is one
contiguous piece, 6.5 MB for Llama 2-13B; method ``staged``).

Semantics. For every layer the lists of a plan apply one after the other::

    swap_out_first (all layers) -> swap_in (layer 0, 1, ...) -> swap_in_ahead (all layers)
        -> swap_out (all layers)

``swap_in_ahead`` copies are for the next step: on CUDA streams this step's compute does not
wait for them; they go by the staged swap-ins' groups of layers and each layer of the next
step waits for its group only (``ahead_waits="layers"``, the default; ``"all"``: the next
step's compute waits for all of them first), so that step starts while the tail of the copies
runs. The synchronous paths copy
them with the step's swap-ins. ``swap_out_first`` (urgent) copies go before the swap-ins, in
one launch for every layer.

A GPU block may be both a ``swap_out_first`` source and a ``swap_in`` destination (its old
content reaches the CPU first); a CPU block may be both a ``swap_in`` source and a ``swap_out``
destination (it is read first). Within one list, GPU ids and CPU ids must be distinct. Steps
apply in order: a later step's copies see every earlier step's copies done.

Methods (:data:`METHODS`):

- ``"staged"`` (the default on CUDA): swap-ins through the copy engines by groups of layers
  (``in_groups``, default 8): per group one ``cuMemcpyBatchAsync`` call
  (:class:`~pensieve.runner.copy_engine.CopyEngine`) into a device staging buffer, then a
  scatter launch into the GPU cache; layer i waits for its group only. Background swap-outs:
  a device-side gather into staging, then one copy per run of consecutive CPU ids, by groups
  of layers, through two staging halves of at most ``staging_chunks`` chunks.
  ``swap_out_first`` through the swap kernel (:mod:`pensieve.kernels.triton_swap`) reading
  the GPU cache and writing the device-mapped host tier. Why staged: both directions through
  the copy engines keep their concurrent rate, where SM reads of the mapped tier take rate
  from the copy engines' writes the other way (measurements of the alternatives in
  docs/performance_history.md, "Swaps between the GPU and CPU tiers").
- ``"dma"`` (the CPU's; on CUDA, when asked for, on one copy stream with an event per layer):
  one copy per run of consecutive CPU ids per layer, through a staging buffer when the GPU ids
  of a run are not consecutive.

Composition. :class:`KVSwapper` decides what is copied when, and holds the copy paths as
objects: the swap kernel's launches (:class:`~pensieve.runner.swap_copies.SwapKernels`, every
method's urgent swap-outs on the staged one), the staged method's staging buffers and copy
engine (:class:`~pensieve.runner.swap_staged.StagedCopies`), or the DMA method's copies
(:class:`~pensieve.runner.swap_copies.DmaCopies`), and the copy streams
(:class:`~pensieve.runner.swap_streams.Streams`). Copy streams, events and the cross-stream
hazards on CUDA are described in :mod:`pensieve.runner.swap_streams`. Index tensors are
uploaded on the stream that uses them and kept referenced until that work is known done.

The host tier is page-locked and device-mapped (``cudaHostRegister``) when the GPU caches are
on CUDA. On the CPU the copies are synchronous: ``swap_out_first`` at ``start_step``, layer
i's swap-ins at ``layer_ready(i)`` (so a caller that forgets to call it reads stale KV on the
CPU as well), the rest at ``end_step`` / ``finish_step``; nothing is ever in flight. Tests run
the staged method's issue logic on CPU tensors through a :class:`Streams` simulator.
"""

from __future__ import annotations

import functools
import os
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from pensieve.core.outputs import SwapPlan
from pensieve.engine.kv_layout import KVLayout
from pensieve.runner.swap_copies import (
    DEFAULT_STAGING_CHUNKS,
    METHODS,
    Batch,
    DmaCopies,
    LayerReady,
    Staged,
    Step,
    SwapKernels,
    allocate_host_tier,
    check_caches,
)
from pensieve.runner.swap_staged import StagedCopies, ahead_waits_of, in_groups_of
from pensieve.runner.swap_streams import (
    IMMEDIATE,
    CudaStreams,
    InFlight,
    OutBatch,
    StepWaits,
    Streams,
    layer_waits,
    pop_completed,
    step_waits,
)

__all__ = ["DEFAULT_STAGING_CHUNKS", "METHODS", "InFlight", "KVSwapper", "StepWaits", "Streams",
           "pop_completed", "step_waits"]


class KVSwapper:
    """The CPU tier plus the step's swap copies (see the module docstring for the rules).

    ``layout``: the engine's :class:`~pensieve.engine.kv_layout.KVLayout`; the CPU tier's
    shape and dtype and the bytes of a chunk (:attr:`layer_bytes`, :attr:`chunk_bytes`) are
    its, and ``gpu_caches`` must match it (ValueError otherwise).
    ``gpu_caches``: one ``[2, num_gpu_blocks, chunk_size, num_kv_heads, head_dim]`` tensor per
    layer (K then V), as :meth:`KVLayout.allocate` makes them: views of one
    ``[num_layers, 2, ...]`` tensor let one kernel launch cover every layer (separate tensors
    work too, one launch per layer). ``num_cpu_blocks`` may be 0 (no CPU tier; only empty
    plans then).

    ``method``: one of :data:`METHODS` (see the module docstring); None: staged on CUDA and
    DMA on the CPU. ``num_programs``: the kernel's persistent grid (None:
    :data:`~pensieve.kernels.launch_swap.DEFAULT_PROGRAMS`). ``staging_chunks``: chunks per
    staging piece and half of the staged method (None: :data:`DEFAULT_STAGING_CHUNKS`).
    ``background``: False makes :meth:`end_step` wait for the background swap-outs too (the
    runner's choice under tensor parallelism, where only rank 0's count reaches the
    scheduler). ``in_groups`` / ``out_groups``: the groups of layers staged swap-ins /
    background swap-outs are copied by (None: ``DEFAULT_IN_GROUPS`` / ``DEFAULT_OUT_GROUPS`` of
    :mod:`~pensieve.runner.swap_staged`). ``ahead_waits``: how the next step waits for
    ``swap_in_ahead`` copies, ``"all"`` or ``"layers"``
    (:func:`~pensieve.runner.swap_staged.ahead_waits_of`; None: ``"layers"`` where it
    applies). ``streams``: for tests, a :class:`Streams` to run the staged method's stream
    logic on CPU tensors.
    """

    def __init__(
        self,
        layout: KVLayout,
        gpu_caches: list[torch.Tensor],
        num_cpu_blocks: int,
        method: str | None = None,
        *,
        num_programs: int | None = None,
        staging_chunks: int | None = None,
        background: bool = True,
        streams: Streams | None = None,
        in_groups: int | None = None,
        out_groups: int | None = None,
        ahead_waits: str | None = None,
    ) -> None:
        check_caches(layout, gpu_caches, num_cpu_blocks)
        first = gpu_caches[0]
        self.layout = layout
        self.gpu_caches = gpu_caches
        self.device = first.device
        self.num_layers = layout.num_layers
        self.num_gpu_blocks = first.shape[1]
        self.num_cpu_blocks = num_cpu_blocks
        self.block_shape = layout.block_shape  # (chunk_size, num_kv_heads, head_dim)
        self.layer_bytes = layout.layer_bytes  # K and V of one block in one layer
        self.chunk_bytes = layout.block_bytes  # of one block over all layers: bytes per chunk
        self._cuda = self.device.type == "cuda"
        method = method or ("staged" if self._cuda else "dma")
        if method not in METHODS:
            raise ValueError(f"swap method {method!r} not in {METHODS}")
        if streams is not None and (self._cuda or method != "staged"):
            raise ValueError("streams= is for the staged method on CPU tensors (tests)")
        if staging_chunks is not None and staging_chunks < 1:
            raise ValueError(f"staging_chunks {staging_chunks} < 1")
        self.method = method
        self.background = background
        self.staging_chunks = staging_chunks or DEFAULT_STAGING_CHUNKS  # per piece and half
        self.in_groups = in_groups_of(in_groups, self.num_layers)
        self.ahead_waits = ahead_waits_of(ahead_waits, method)  # "all" | "layers"
        chunk_major = method == "staged"
        self.host_layout = "chunk-major" if chunk_major else "layer-major"
        """``"layer-major"``: :attr:`host_tier` is ``[L, 2, num_cpu_blocks, C, Hkv, D]``;
        ``"chunk-major"``: ``[num_cpu_blocks, L, 2, C, Hkv, D]``."""
        self._host, layers, self._host_view, self.pinned = allocate_host_tier(
            num_cpu_blocks, self.num_layers, self.block_shape, layout.dtype, chunk_major,
            self.device, self)
        """``_host_view``: what the kernel gets for the CPU tier, ``[L, 2, num_cpu_blocks,
        ...]`` (strided when chunk-major): a MappedHost on CUDA, else the tensor. ``pinned``:
        whether the CPU tier is page-locked (and device-mapped)."""
        self.cpu_caches: list[torch.Tensor] = list(layers.unbind(0))
        """One ``[2, num_cpu_blocks, chunk_size, num_kv_heads, head_dim]`` view per layer of
        :attr:`host_tier` (contiguous only when layer-major)."""
        from pensieve.kernels.launch_swap import DEFAULT_PROGRAMS

        self.kernels = SwapKernels(gpu_caches, num_programs or DEFAULT_PROGRAMS,
                                   self._cuda or os.environ.get("TRITON_INTERPRET") == "1")
        """The swap kernel's launches (urgent swap-outs; staged gathers and scatters)."""
        self.staged: StagedCopies | None = None  # the staged method's copies, or
        self.dma: DmaCopies | None = None  # the DMA method's
        if method == "staged":
            self.staged = StagedCopies(self.kernels, self._host, layout, self.staging_chunks,
                                       out_groups)
        else:
            self.dma = DmaCopies(gpu_caches, self.cpu_caches, num_cpu_blocks)
        self._streams: Streams | None = streams
        """The staged method's copy streams: CUDA's, or a test's simulator (None: DMA, or the
        synchronous path on the CPU)."""
        if self._cuda and method == "staged":
            self._streams = CudaStreams(self.device)
        self._step: Step | None = None
        self._deferred: Callable[[], None] | None = None  # start_step's deferred copies
        self._in_flight: deque[OutBatch] = deque()
        self._ahead: deque[tuple[Any, Any, list[Any] | None]] = deque()
        """Streams: (event, references, per-layer events with ``ahead_waits="layers"``) of
        each step's ``swap_in_ahead`` copies not seen done; the next step's compute waits for
        the newest (one stream: it covers the older), before anything or layer by layer."""
        self.bytes_in = self.bytes_out = 0
        """Cumulative bytes copied CPU -> GPU and GPU -> CPU (K and V, all layers)."""
        if self._cuda and method == "staged" and num_cpu_blocks and self.num_gpu_blocks:
            self._compile()

    # ------------------------------------------------------------------ step API

    @torch.inference_mode()
    def start_step(self, plan: SwapPlan, defer_background: bool = False) -> LayerReady | None:
        """Issue the plan's copies; returns the ``layer_ready`` callback, or None if no wait.

        On CUDA every copy is enqueued before this returns (the host does not wait); the
        callback makes the *current* stream wait for layer i. A step not yet ended is ended
        first (:meth:`end_step`). Raises ValueError (and copies nothing) on an invalid plan.
        ``defer_background`` (streams only): the copies the step's compute never waits for
        (``swap_in_ahead``, background ``swap_out``) are issued by :meth:`issue_background`
        instead, which the caller calls once the forward is issued (the copies then wait for
        the same events: only the host's work moves), or else :meth:`end_step` does.
        """
        if self._step is not None:
            self.end_step()
        ahead = self._wait_ahead()
        if self._streams is not None and not plan.is_empty:
            return self._start_streams(plan, ahead, defer_background)
        if plan.is_empty:
            return None if ahead is None else layer_waits(self._streams, [ahead],
                                                          self._check_layer)
        if plan.swap_in_ahead:  # synchronous paths: copied with the step's own swap-ins
            plan = SwapPlan(plan.swap_out_first, plan.swap_in + plan.swap_in_ahead,
                            plan.swap_out)
        if self.dma is not None and self.dma.stream is not None:
            return self._start_dma_cuda(plan)
        step = self._prepare(plan)
        for_all = range(self.num_layers)
        self._apply(step.out_first, False, for_all)
        self._step = step
        if step.swap_in is None:
            return None

        def layer_ready(i: int) -> None:
            self._check_layer(i)
            with torch.inference_mode():
                self._sync_in(step, i + 1)

        return layer_ready

    def _wait_ahead(self) -> list[Any] | None:
        """The compute stream waits for the earlier steps' ``swap_in_ahead`` copies; with
        ``ahead_waits="layers"`` only the out stream does (the compute stream no longer orders
        the swap-outs after them), and this returns the per-layer events the step's layers
        wait for instead."""
        if not self._ahead:
            return None
        st, (last, _, layers) = self._streams, self._ahead[-1]
        assert st is not None
        if layers is None:
            st.wait(None, last)
            return None
        st.wait(st.out_stream, last)
        return layers

    def end_step(self) -> int:
        """End the step: wait for what it needs and return how many background swap-out
        batches are still in flight (this step's included; 0 when all are done).

        Staged method on CUDA: waits for the step's urgent swap-outs and swap-ins only (the
        compute stream's sync has normally covered them) and polls the background batches
        (with ``background=False`` waits for them too). DMA and the CPU: every copy of the
        step is complete on return (0)."""
        self.issue_background()
        step, self._step = self._step, None
        if self._streams is None:
            self._finish_sync(step)
            return 0
        st = self._streams
        if step is not None and step.in_done is not None:
            st.synchronize(step.in_done)
        if not self.background:
            self._drain()
        pop_completed(self._ahead, lambda a: st.query(a[0]))
        return pop_completed(self._in_flight, lambda b: st.query(b.event))

    def finish_step(self) -> None:
        """Block until every copy issued so far is complete, background swap-outs of earlier
        steps included (no-op when none is in flight)."""
        self.end_step()
        self._drain()
        if self._ahead:
            assert self._streams is not None
            self._streams.synchronize(self._ahead[-1][0])
            self._ahead.clear()

    @property
    def host_tier(self) -> torch.Tensor:
        """The whole CPU tier, contiguous, in :attr:`host_layout`."""
        return self._host

    @property
    def swap_outs_in_flight(self) -> int:
        """Background batches not yet seen complete (as of the last :meth:`end_step`)."""
        return len(self._in_flight)

    @property
    def num_copies(self) -> int:
        """Cumulative host<->device copies (DMA: K and V per run per layer; staged: per run, or
        per chunk per group of layers) plus kernel launches."""
        return self.kernels.num_copies + sum(p.num_copies for p in (self.staged, self.dma)
                                             if p is not None)

    @property
    def num_programs(self) -> int:
        """Persistent grid of each kernel launch (may be changed between steps)."""
        return self.kernels.num_programs

    @num_programs.setter
    def num_programs(self, value: int) -> None:
        self.kernels.num_programs = value

    @property
    def tile_bytes(self) -> int | None:
        """Bytes per program per loop iteration of the kernel (None: the launcher's
        default); may be changed between steps (the benchmark's sweep)."""
        return self.kernels.tile_bytes

    @tile_bytes.setter
    def tile_bytes(self, value: int | None) -> None:
        self.kernels.tile_bytes = value

    # ------------------------------------------------------------------ streams

    def issue_background(self) -> None:
        """Issue the copies :meth:`start_step` deferred (no-op when none are)."""
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            deferred()

    def _start_streams(self, plan: SwapPlan, ahead: list[Any] | None, defer: bool
                       ) -> LayerReady | None:
        st, staged = self._streams, self.staged
        assert st is not None and staged is not None
        plan.check(self.num_gpu_blocks, self.num_cpu_blocks)
        waits = step_waits(plan, [b.touches for b in self._in_flight])
        self._count(plan)
        layers = self.num_layers
        step = Step()
        compute_done = st.record(None)
        events: list[Any] = []
        if plan.swap_out_first or plan.swap_in or plan.swap_in_ahead:
            st.wait(st.in_stream, compute_done)
            if waits.in_after >= 0:
                st.wait(st.in_stream, self._in_flight[waits.in_after].event)
        if plan.swap_out_first or plan.swap_in:
            s = st.in_stream
            if plan.swap_out_first:
                step.out_first = st.upload(s, plan.swap_out_first)
                st.run(s, functools.partial(self.kernels.launch, self._host_spans(False),
                                            step.out_first, 0, layers))
            if plan.swap_in:
                step.swap_in, events = staged.issue_in(st, s, plan.swap_in, self.in_groups)
            else:
                events = [st.record(s)] * layers
            step.in_done = events[-1]
        background = functools.partial(self._issue_background, st, plan, compute_done,
                                       step.in_done, waits.out_after_in)
        if defer and (plan.swap_in_ahead or plan.swap_out):
            self._deferred = background
        else:
            background()
        step.events = events
        self._step = step
        # the step's own events follow the ahead copies on the in stream: they cover them
        layer_events = events or ahead
        return (None if layer_events is None
                else layer_waits(st, [layer_events], self._check_layer))

    def _issue_background(self, st: Streams, plan: SwapPlan, compute_done: Any, last_in: Any,
                          out_after_in: bool) -> None:
        """A step's copies its compute does not wait for: ``swap_in_ahead`` after its
        swap-ins on the in stream, then the background ``swap_out`` on the out stream."""
        staged = self.staged
        assert staged is not None
        if plan.swap_in_ahead:  # after the step's swap-ins; this step's compute never waits
            s = st.in_stream
            by_layer: list[Any] | None = None
            if self.ahead_waits == "layers":  # by groups, as the step's own swap-ins
                refs, by_layer = staged.issue_in(st, s, plan.swap_in_ahead, self.in_groups)
            else:
                refs = staged.issue_in(st, s, plan.swap_in_ahead)[0]
            last_in = st.record(s)
            self._ahead.append((last_in, refs, by_layer))
        if plan.swap_out:
            self._issue_out(st, plan, compute_done, last_in if out_after_in else None)

    def _issue_out(self, st: Streams, plan: SwapPlan, compute_done: Any, after: Any) -> None:
        """Issue ``plan``'s background swap-outs on the out stream, after ``compute_done``
        (the compute before the step) and ``after`` (an in-stream event, or None), and put
        the batch in flight."""
        assert self.staged is not None
        s = st.out_stream
        st.wait(s, compute_done)
        if after is not None:
            st.wait(s, after)
        event, refs = self.staged.issue_out(st, plan.swap_out, s, st.dma_stream)
        touches = InFlight(frozenset(c for _, c in plan.swap_out),
                           frozenset(g for g, _ in plan.swap_out))
        self._in_flight.append(OutBatch(event, refs, touches))

    def _drain(self) -> None:
        if self._in_flight:
            assert self._streams is not None
            self._streams.synchronize(self._in_flight[-1].event)
            self._in_flight.clear()

    # ------------------------------------------------------------------ synchronous paths

    def _apply(self, obj: Any, to_gpu: bool, layers: range) -> None:
        """Run one list's copies for ``layers`` now (DMA batch, staged pairs, or urgent
        swap-outs' kernel pairs)."""
        if obj is None or not layers:
            return
        if isinstance(obj, Batch):
            assert self.dma is not None
            for layer in layers:
                (self.dma.copy_in if to_gpu else self.dma.copy_out)(obj, layer)
        elif isinstance(obj, Staged):  # every layer at once
            assert self.staged is not None
            if to_gpu:
                self.staged.issue_in(IMMEDIATE, None, obj.pairs)
            else:
                self.staged.issue_out(IMMEDIATE, obj.pairs, None, None)
        else:
            self.kernels.launch(self._host_spans(to_gpu), obj, layers.start, layers.stop)

    def _sync_in(self, step: Step, upto: int) -> None:
        """Synchronous path: run the swap-ins of layers below ``upto`` not run yet (staged:
        all layers at the first call)."""
        if step.next_in_layer < upto:
            if isinstance(step.swap_in, Staged):
                upto = self.num_layers
            self._apply(step.swap_in, True, range(step.next_in_layer, upto))
            step.next_in_layer = upto

    def _finish_sync(self, step: Step | None) -> None:
        if step is None:
            return
        if self.dma is not None and self.dma.stream is not None:
            self.dma.stream.synchronize()
            return
        with torch.inference_mode():
            self._sync_in(step, self.num_layers)
            self._apply(step.swap_out, False, range(self.num_layers))

    # ------------------------------------------------------------------ plans

    def _check_layer(self, i: int) -> None:
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer {i} not in [0, {self.num_layers})")

    def _count(self, plan: SwapPlan) -> None:
        n_out = len(plan.swap_out_first) + len(plan.swap_out)
        self.bytes_out += n_out * self.chunk_bytes
        self.bytes_in += plan.num_swap_in_chunks * self.chunk_bytes

    def _prepare(self, plan: SwapPlan) -> Step:
        """Synchronous and DMA paths: validate, then batch the three lists."""
        plan.check(self.num_gpu_blocks, self.num_cpu_blocks)
        if self.dma is not None:
            step = self.dma.batch_plan(plan)
        else:  # staged, synchronous: the pairs, urgent swap-outs as a pair tensor
            def staged(pairs: list[tuple[int, int]]) -> Staged | None:
                return Staged(list(pairs)) if pairs else None

            out_first = (torch.tensor(plan.swap_out_first, dtype=torch.int64)
                         if plan.swap_out_first else None)
            step = Step(out_first, staged(plan.swap_in), staged(plan.swap_out))
        self._count(plan)
        return step

    def _start_dma_cuda(self, plan: SwapPlan) -> LayerReady | None:
        """DMA on CUDA: the step's copies on the copy stream; layer i's compute waits for its
        event."""
        assert self.dma is not None
        step = self.dma.issue_on_stream(lambda: self._prepare(plan))
        self._step = step
        events = step.events
        if not events:
            return None

        def layer_ready(i: int) -> None:
            self._check_layer(i)
            torch.cuda.current_stream(self.device).wait_event(events[i])

        return layer_ready

    def _host_spans(self, to_gpu: bool) -> list[tuple[int, int, Any]]:
        """The kernel's launches between the GPU caches and the host tier."""
        return self.kernels.spans(("host", to_gpu), self._host_view, to_gpu, 0,
                                  self.num_layers)

    def _compile(self) -> None:
        """Compile the kernel before serving (a first-use compile stalls a step ~1 s): GPU
        block 0 to CPU block 0 (an urgent swap-out's launch), then through the staging buffers
        out and back in, which changes no GPU byte (and allocates the buffers with one row)."""
        st, staged = self._streams, self.staged
        assert st is not None and staged is not None
        pairs = torch.zeros(1, 2, dtype=torch.int64, device=self.device)
        s = st.in_stream
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            self.kernels.launch(self._host_spans(False), pairs, 0, self.num_layers)
            staged.grow_out(1)
            for _ in range(2):  # both halves, by the swap-outs' groups of layers
                staged.issue_out(st, [(0, 0)], s, s)
            # CPU block 0 holds GPU block 0 now
            staged.issue_in(st, s, [(0, 0)])
            staged.issue_in(st, s, [(0, 0)], self.in_groups)
        s.synchronize()
        self.kernels.num_copies = staged.num_copies = 0
