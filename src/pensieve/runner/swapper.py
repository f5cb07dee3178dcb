"""The CPU tier of the KV cache and the copies between it and the GPU tier.

Owns one pinned host tensor holding, per layer, K then V of every CPU block, in the GPU caches'
dtype; :attr:`KVSwapper.cpu_caches` are its per-layer ``[2, num_cpu_blocks, chunk_size,
num_kv_heads, head_dim]`` views, whatever the layout (:attr:`KVSwapper.host_layout`):

- ``"layer-major"`` (methods ``kernel`` and ``dma``): ``[num_layers, 2, num_cpu_blocks, C,
  Hkv, D]``; each per-layer view is contiguous (one chunk of one layer's K = one piece);
- ``"chunk-major"`` (methods ``hybrid`` and ``staged``): ``[num_cpu_blocks, num_layers, 2, C,
  Hkv, D]``, so one chunk of every layer is one contiguous piece (6.5 MB for Llama 2-13B) and
  a run of consecutive CPU blocks one larger piece; the per-layer views are strided (not
  contiguous: ``reshape(-1)`` on them copies). :attr:`KVSwapper.host_tier` is the whole
  tensor in either layout.

Semantics. For every layer the three lists of a plan apply one after the other::

    swap_out_first (all layers) -> swap_in (layer 0, 1, ...) -> swap_out (all layers)

A GPU block may be both a ``swap_out_first`` source and a ``swap_in`` destination (its old
content reaches the CPU first); a CPU block may be both a ``swap_in`` source and a ``swap_out``
destination (it is read first). Within one list, GPU ids and CPU ids must be distinct. Steps
apply in order: a later step's copies see every earlier step's copies done.

Methods (:data:`METHODS`; ``PENSIEVE_SWAP_METHOD`` picks one when the constructor is given
None):

- ``"kernel"``: one Triton gather/scatter launch copies a whole list (or one
  layer of it) with the GPU's SMs reading and writing the pinned, device-mapped CPU tier
  directly (:mod:`pensieve.kernels.triton_swap`), so scattered block ids cost no more than
  consecutive ones. Both directions through the SMs.
- ``"hybrid"`` (default on CUDA): chunk-major host tier. Swap-ins and ``swap_out_first`` as
  ``kernel`` (SMs, zero-copy; swap-ins layer-pipelined). Background ``swap_out`` through the
  copy engines: the kernel gathers the chunks device-to-device into a contiguous device staging
  buffer ``[n, L, 2, C, Hkv, D]`` (rows in CPU-id order), then one ``cudaMemcpyAsync`` per
  maximal run of consecutive CPU ids (one chunk of all layers or more per copy). Staged in
  pieces of at most ``staging_chunks`` chunks through two staging halves (so the staging memory
  is bounded, 2 x ``staging_chunks`` chunks, and the gather of piece k+1 overlaps the copy of
  piece k).
  Chosen by measurement (H200, 13B GQA-10 shape, random block ids, 64-1024 chunks,
  ``benchmarks/swap_bandwidth.py``): in 45.6-48.6 GB/s and out 46.5-53.7 GB/s alone (kernel:
  46.6-48.7 / 49.7-50.2), in + out together 30.5-33.4 GB/s each way (kernel: 27-29), and a
  GEMM beside in + out copies slowed 1.12-1.18x (kernel: 1.36-1.43x: SM copies both ways take
  compute from the model).
- ``"staged"``: as ``hybrid``, and swap-ins through the copy engines as well: one
  ``cudaMemcpyAsync`` per run of consecutive CPU ids into a device staging buffer (at most
  ``staging_chunks`` chunks at a time), then a device-side scatter launch into the GPU
  cache. Not layer-pipelined: every layer waits for all of the step's swap-ins.
- ``"dma"`` (default on the CPU, where it is plain tensor copies): one ``cudaMemcpy`` per run
  of consecutive CPU ids per layer for K and for V, through a staging buffer when the GPU ids
  of a run are not consecutive (the method before the kernel, kept for comparison).

CUDA, kernel, hybrid and staged methods: copy streams and the compute (current) stream.

- The *in* stream (high priority) runs ``swap_out_first`` (one launch, all layers), then the
  swap-ins, one launch per layer with an event after each: ``layer_ready(i)`` makes the
  compute stream wait for layer i's event (which follows every ``swap_out_first`` copy too),
  so layer i's attention sees its swapped-in KV and never writes a block before its old
  content is copied out.
- The *out* stream runs the background ``swap_out`` (one launch, all layers), concurrently
  with the in stream (PCIe is full duplex). It is not waited for at the end of the step: each
  such batch joins a FIFO of batches in flight (its event, its index tensor, the CPU blocks it
  writes, the GPU blocks it reads). They complete in plan order (one stream).
- ``hybrid`` / ``staged``: the out stream runs the gathers into the staging halves and the
  *dma* stream the device-to-host copies, each piece's copies after its gather (an event),
  each gather into a half after the copies of the piece that used that half before (the
  half's "free" event, kept across batches and steps). The batch's event is recorded on the
  dma stream after its last copy: it covers the batch's gathers, and every older batch (one
  dma stream), so the FIFO and the hazard waits below are unchanged. A batch keeps its index
  tensor and staging halves referenced until it is popped complete. ``staged`` swap-ins run
  on the in stream: copies into the in-staging buffer, then the scatter, piece by piece.
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

Index tensors are uploaded on the stream that uses them and kept referenced until that work
is known done. The staging buffers grow on demand (never beyond ``staging_chunks`` chunks per
half) and are allocated on the first swap that needs them; a replaced buffer stays referenced
by the batches still using it. The DMA method on CUDA keeps the earlier scheme: every copy on
one stream, and :meth:`~KVSwapper.end_step` blocks until all of them are done (they share a
staging buffer).

The host tier is page-locked and device-mapped (``cudaHostRegister``, portable and mapped,
exact size) when the GPU caches are on CUDA. On the CPU the copies are synchronous:
``swap_out_first`` at ``start_step``, layer i's swap-ins at ``layer_ready(i)`` (so a caller
that forgets to call it reads stale KV on the CPU as well), the rest at ``end_step`` /
``finish_step``; nothing is ever in flight. The kernel method on the CPU runs the Triton
kernel through the interpreter when ``TRITON_INTERPRET=1``, else its torch reference; the
hybrid and staged methods run the same issue logic as on CUDA (pieces, halves, runs) with
every operation executed at once (``staged`` swap-ins at the first ``layer_ready``).
"""

from __future__ import annotations

import functools
import os
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pensieve.core.copy_order import copy_waits
from pensieve.core.outputs import SwapPlan

LayerReady = Callable[[int], None]
METHODS = ("kernel", "hybrid", "staged", "dma")
CHUNK_MAJOR = ("hybrid", "staged")
"""Methods with the chunk-major host tier and the staged (copy-engine) swap-outs."""
STREAM_METHODS = ("kernel", "hybrid", "staged")
"""Methods run through :class:`Streams` (CUDA, or a test's simulator)."""
DEFAULT_STAGING_CHUNKS = 64
"""Chunks per staging half (hybrid and staged): the device staging memory is at most 2 x this
(out) + this (staged in) chunks of all layers (13B: 6.5 MB each)."""


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
    """The hybrid methods' device-to-host copies of staged swap-outs."""

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
    """:class:`Streams` on a CUDA device: a high-priority in stream, a normal out stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # High priority: swap-ins are on the step's critical path.
        self.in_stream = torch.cuda.Stream(device, priority=-1)
        self.out_stream = torch.cuda.Stream(device)
        self.dma_stream = torch.cuda.Stream(device)

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
        with torch.cuda.stream(stream):  # allocated for, and copied on, that stream
            return host.to(self.device, non_blocking=True)

    def run(self, stream: torch.cuda.Stream, fn: Callable[[], None]) -> None:
        with torch.cuda.stream(stream):
            fn()

    def query(self, event: torch.cuda.Event) -> bool:
        return event.query()

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()


class _Immediate:
    """:class:`Streams` that run every operation at once (the synchronous path: the hybrid
    methods' staging logic on the CPU)."""

    in_stream = out_stream = dma_stream = None

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


_IMMEDIATE = _Immediate()


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


# ---------------------------------------------------------------------- DMA batching


class _Runs:
    """Views ``t[start : start + length]`` along dim 0 of a fixed set of disjoint runs.

    One ``split`` call per tensor instead of one slice per run (host overhead matters when a
    plan has thousands of runs on 40 layers).
    """

    def __init__(self, starts: list[int], lengths: list[int], total: int) -> None:
        sizes: list[int] = []
        pick = [0] * len(starts)
        pos = 0
        for j in sorted(range(len(starts)), key=starts.__getitem__):
            if starts[j] > pos:
                sizes.append(starts[j] - pos)
            pick[j] = len(sizes)
            sizes.append(lengths[j])
            pos = starts[j] + lengths[j]
        if total > pos:
            sizes.append(total - pos)
        self.sizes = sizes
        self.pick = pick

    def views(self, t: torch.Tensor) -> list[torch.Tensor]:
        parts = t.split(self.sizes)
        return [parts[i] for i in self.pick]


@dataclass
class _Batch:
    """DMA: one list of a plan, sorted by CPU block and cut into runs of consecutive CPU ids."""

    n: int
    cpu: _Runs
    """Runs on the CPU tier's block dim."""
    gpu: _Runs | None
    """Direct copies: the same runs on the GPU cache's block dim (every run is consecutive on
    both sides); None when staged."""
    stage: _Runs | None
    """Staged copies: the runs on the staging buffer's block dim (row ``j`` = ``j``-th pair)."""
    index: torch.Tensor | None
    """Staged copies: ``[n]`` int64 GPU block of each staging row, on the GPU caches' device."""
    num_runs: int


@dataclass
class _Step:
    """The step's copies not known complete, kept referenced until :meth:`KVSwapper.end_step`.

    ``out_first``, ``swap_in``, ``swap_out``: a :class:`_Batch` (DMA), an ``[n, 2]`` pair tensor
    (kernel), a :class:`_Staged` (hybrid swap-outs, staged swap-ins, synchronous path), or
    None; on CUDA also the references that staged work keeps alive."""

    out_first: Any = None
    swap_in: Any = None
    swap_out: Any = None
    next_in_layer: int = 0
    """Synchronous path only: first layer whose swap-ins have not run yet."""
    events: list[Any] | None = None
    in_done: Any = None
    """Kernel streams: event after the step's in-stream work (None if it had none)."""


@dataclass
class _Staged:
    """A list run through the staging buffers: ``pairs`` (src, dst) as the plan gives them."""

    pairs: list[tuple[int, int]]


@dataclass
class _OutBatch:
    """A background swap-out batch in flight (kernel streams)."""

    event: Any
    refs: Any
    """What its work uses and must stay allocated until ``event``: the index tensor, and the
    staging halves (hybrid, staged)."""
    touches: InFlight


# ---------------------------------------------------------------------- the swapper


class KVSwapper:
    """The CPU tier plus the step's swap copies (see the module docstring for the rules).

    ``gpu_caches``: one ``[2, num_gpu_blocks, chunk_size, num_kv_heads, head_dim]`` tensor per
    layer (K then V), as ``allocate_kv_caches`` makes them: views of one
    ``[num_layers, 2, ...]`` tensor let one kernel launch cover every layer (separate tensors
    work too, one launch per layer). ``num_cpu_blocks`` may be 0 (no CPU tier; only empty
    plans then).

    ``method``: one of :data:`METHODS` (see the module docstring); None:
    ``PENSIEVE_SWAP_METHOD`` if set, else kernel on CUDA and DMA on the CPU. ``num_programs``:
    the kernel's persistent grid (None: :data:`~pensieve.kernels.launch_swap.DEFAULT_PROGRAMS`).
    ``staging_chunks``: chunks per staging piece and half of the hybrid and staged methods
    (None: :data:`DEFAULT_STAGING_CHUNKS`). ``background``: False makes
    :meth:`end_step` wait for the background swap-outs too (the runner's choice under tensor
    parallelism, where only rank 0's count reaches the scheduler). ``streams``: for tests, a
    :class:`Streams` to run the kernel, hybrid or staged method's stream logic on CPU tensors.
    """

    def __init__(
        self,
        gpu_caches: list[torch.Tensor],
        num_cpu_blocks: int,
        method: str | None = None,
        *,
        num_programs: int | None = None,
        staging_chunks: int | None = None,
        background: bool = True,
        streams: Streams | None = None,
    ) -> None:
        if not gpu_caches:
            raise ValueError("no KV caches")
        first = gpu_caches[0]
        if first.dim() != 5 or first.shape[0] != 2:
            raise ValueError(f"KV cache shape {tuple(first.shape)} is not [2, N, C, Hkv, D]")
        for c in gpu_caches:
            if c.shape != first.shape or c.dtype != first.dtype or c.device != first.device:
                raise ValueError("KV caches differ in shape, dtype or device across layers")
            if not c.is_contiguous():
                raise ValueError("KV caches must be contiguous")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks {num_cpu_blocks} < 0")
        self.gpu_caches = gpu_caches
        self.device = first.device
        self.num_layers = len(gpu_caches)
        self.num_gpu_blocks = first.shape[1]
        self.num_cpu_blocks = num_cpu_blocks
        self.block_shape = tuple(first.shape[2:])
        """``(chunk_size, num_kv_heads, head_dim)``."""
        self.block_bytes = 2 * first[0, 0].numel() * first.element_size()
        """Bytes of K and V of one block in one layer."""
        self._cuda = self.device.type == "cuda"
        method = method or os.environ.get("PENSIEVE_SWAP_METHOD") or (
            "hybrid" if self._cuda else "dma")
        if method not in METHODS:
            raise ValueError(f"swap method {method!r} not in {METHODS}")
        if streams is not None and (self._cuda or method not in STREAM_METHODS):
            raise ValueError(f"streams= is for the {STREAM_METHODS} methods on CPU tensors "
                             "(tests)")
        if staging_chunks is not None and staging_chunks < 1:
            raise ValueError(f"staging_chunks {staging_chunks} < 1")
        self.method = method
        from pensieve.kernels.launch_swap import DEFAULT_PROGRAMS

        self._num_programs = num_programs or DEFAULT_PROGRAMS
        self._tile_bytes: int | None = None
        self.background = background
        self.staging_chunks = staging_chunks or DEFAULT_STAGING_CHUNKS
        """Hybrid and staged methods: chunks per staging piece and half."""
        chunk_major = method in CHUNK_MAJOR
        self.host_layout = "chunk-major" if chunk_major else "layer-major"
        """``"layer-major"``: :attr:`host_tier` is ``[L, 2, num_cpu_blocks, C, Hkv, D]``;
        ``"chunk-major"``: ``[num_cpu_blocks, L, 2, C, Hkv, D]``."""
        if chunk_major:
            self._host = torch.empty((num_cpu_blocks, self.num_layers, 2, *self.block_shape),
                                     dtype=first.dtype)
            layers = self._host.permute(1, 2, 0, 3, 4, 5)
        else:
            self._host = torch.empty((self.num_layers, 2, num_cpu_blocks, *self.block_shape),
                                     dtype=first.dtype)
            layers = self._host
        self.pinned = self._cuda and self._host.numel() > 0
        """Whether the CPU tier is page-locked (and device-mapped)."""
        self._host_view: Any = layers
        """What the kernel gets for the CPU tier, ``[L, 2, num_cpu_blocks, ...]`` (strided when
        chunk-major): a MappedHost on CUDA, else the tensor."""
        if self.pinned:
            from pensieve.kernels.launch_swap import register_host, unregister_host

            mapped = register_host(self._host, self.device)
            self._host_view = mapped.permute(1, 2, 0, 3, 4, 5) if chunk_major else mapped
            weakref.finalize(self, unregister_host, self._host)
        self.cpu_caches: list[torch.Tensor] = list(layers.unbind(0))
        """One ``[2, num_cpu_blocks, chunk_size, num_kv_heads, head_dim]`` view per layer of
        :attr:`host_tier` (contiguous only when layer-major)."""
        self._gpu_stack = _stacked(gpu_caches)
        """``[num_layers, 2, ...]`` view of the GPU caches when they are evenly spaced views of
        one storage; None: one launch per layer."""
        self._triton = self._cuda or os.environ.get("TRITON_INTERPRET") == "1"
        self._copies: dict[tuple[str, bool], list[tuple[int, int, Any]]] = {}
        """Kernel launches per (other tier, towards the GPU): ``(first_layer, end_layer, copy)``
        covering the layers (one span when the caches are stacked), built at first use. Other
        tiers: ``"host"``, the out-staging halves ``"out0"`` / ``"out1"``, the in-staging
        buffer ``"in"``."""
        self._out_stage: list[torch.Tensor] = []
        """Hybrid, staged: the two ``[rows, L, 2, C, Hkv, D]`` device staging halves of the
        swap-outs (rows <= staging_chunks; grown on demand)."""
        self._half_free: list[Any] = [None, None]
        """Event after the last copy out of each half (None: free)."""
        self._next_half = 0
        self._in_stage: torch.Tensor | None = None
        """Staged: the ``[rows, L, 2, C, Hkv, D]`` device staging buffer of the swap-ins."""
        self._streams: Streams | None = streams
        self._stream: torch.cuda.Stream | None = None  # DMA on CUDA
        if self._cuda and method in STREAM_METHODS:
            self._streams = CudaStreams(self.device)
        elif self._cuda:
            # High priority: the swap-in scatter kernels should not queue behind compute.
            self._stream = torch.cuda.Stream(self.device, priority=-1)
        self._staging = torch.empty(0, dtype=first.dtype, device=self.device)
        self._step: _Step | None = None
        self._in_flight: deque[_OutBatch] = deque()
        self.bytes_in = 0
        """Cumulative bytes copied CPU -> GPU (K and V, all layers)."""
        self.bytes_out = 0
        """Cumulative bytes copied GPU -> CPU."""
        self.num_copies = 0
        """Cumulative copy calls issued: host<->device memcpys (DMA: two per run per layer, K
        and V; hybrid and staged: one per run of consecutive CPU ids per piece, all layers)
        plus kernel launches."""
        if self._cuda and method in STREAM_METHODS and num_cpu_blocks and self.num_gpu_blocks:
            self._compile()

    # ------------------------------------------------------------------ step API

    @torch.inference_mode()
    def start_step(self, plan: SwapPlan) -> LayerReady | None:
        """Issue the plan's copies; returns the ``layer_ready`` callback, or None if no wait.

        On CUDA every copy is enqueued before this returns (the host does not wait); the
        callback makes the *current* stream wait for layer i. A step not yet ended is ended
        first (:meth:`end_step`). Raises ValueError (and copies nothing) on an invalid plan.
        """
        if self._step is not None:
            self.end_step()
        if plan.is_empty:
            return None
        if self._streams is not None:
            return self._start_streams(plan)
        if self._stream is not None:
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

    def end_step(self) -> int:
        """End the step: wait for what it needs and return how many background swap-out
        batches are still in flight (this step's included; 0 when all are done).

        Kernel method on CUDA: waits for the step's urgent swap-outs and swap-ins only (the
        compute stream's sync has normally covered them) and polls the background batches
        (with ``background=False`` waits for them too). DMA and the CPU: every copy of the
        step is complete on return (0)."""
        step, self._step = self._step, None
        if self._streams is None:
            self._finish_sync(step)
            return 0
        st = self._streams
        if step is not None and step.in_done is not None:
            st.synchronize(step.in_done)
        if not self.background:
            self._drain()
        return pop_completed(self._in_flight, lambda b: st.query(b.event))

    def finish_step(self) -> None:
        """Block until every copy issued so far is complete, background swap-outs of earlier
        steps included (no-op when none is in flight)."""
        self.end_step()
        self._drain()

    @property
    def host_tier(self) -> torch.Tensor:
        """The whole CPU tier, contiguous, in :attr:`host_layout`."""
        return self._host

    @property
    def swap_outs_in_flight(self) -> int:
        """Background batches not yet seen complete (as of the last :meth:`end_step`)."""
        return len(self._in_flight)

    # ------------------------------------------------------------------ kernel, streams

    def _start_streams(self, plan: SwapPlan) -> LayerReady | None:
        st = self._streams
        assert st is not None
        self._validate(plan)
        waits = step_waits(plan, [b.touches for b in self._in_flight])
        self._count(plan)
        layers = self.num_layers
        step = _Step()
        compute_done = st.record(None)
        events: list[Any] = []
        if plan.swap_out_first or plan.swap_in:
            s = st.in_stream
            st.wait(s, compute_done)
            if waits.in_after >= 0:
                st.wait(s, self._in_flight[waits.in_after].event)
            if plan.swap_out_first:
                step.out_first = st.upload(s, plan.swap_out_first)
                st.run(s, functools.partial(self._kernel, step.out_first, False, 0, layers))
            if plan.swap_in and self.method == "staged":
                step.swap_in = self._issue_in_staged(st, s, plan.swap_in)
                events = [st.record(s)] * layers
            elif plan.swap_in:
                step.swap_in = st.upload(s, plan.swap_in)
                for layer in range(layers):
                    st.run(s, functools.partial(self._kernel, step.swap_in, True, layer,
                                                layer + 1))
                    events.append(st.record(s))
            else:
                events = [st.record(s)] * layers
            step.in_done = events[-1]
        if plan.swap_out:
            s = st.out_stream
            st.wait(s, compute_done)
            if waits.out_after_in:
                st.wait(s, step.in_done)
            if self.method in CHUNK_MAJOR:
                event, refs = self._issue_out_staged(st, plan.swap_out, s, st.dma_stream)
            else:
                refs = st.upload(s, plan.swap_out)
                st.run(s, functools.partial(self._kernel, refs, False, 0, layers))
                event = st.record(s)
            touches = InFlight(frozenset(c for _, c in plan.swap_out),
                               frozenset(g for g, _ in plan.swap_out))
            self._in_flight.append(_OutBatch(event, refs, touches))
        step.events = events
        self._step = step
        if not events:
            return None

        def layer_ready(i: int) -> None:
            self._check_layer(i)
            st.wait(None, events[i])

        return layer_ready

    def _drain(self) -> None:
        if self._in_flight:
            assert self._streams is not None
            self._streams.synchronize(self._in_flight[-1].event)
            self._in_flight.clear()

    @property
    def num_programs(self) -> int:
        """Persistent grid of each kernel launch (may be changed between steps)."""
        return self._num_programs

    @num_programs.setter
    def num_programs(self, value: int) -> None:
        if value < 1:
            raise ValueError(f"num_programs {value} < 1")
        self._num_programs = value
        for spans in self._copies.values():
            for _, _, copy in spans:
                copy.num_programs = value

    @property
    def tile_bytes(self) -> int | None:
        """Bytes per program per loop iteration of the kernel (None: the launcher's
        default); may be changed between steps (the benchmark's sweep)."""
        return self._tile_bytes

    @tile_bytes.setter
    def tile_bytes(self, value: int | None) -> None:
        from pensieve.kernels.launch_swap import DEFAULT_TILE_BYTES

        self._tile_bytes = value
        for spans in self._copies.values():
            for _, _, copy in spans:
                copy.tile_bytes = value or DEFAULT_TILE_BYTES

    def _tier(self, name: str) -> Any:
        """``[L, 2, blocks, C, Hkv, D]`` view of the tier ``name`` (see :attr:`_copies`)."""
        if name == "host":
            return self._host_view
        t = self._in_stage if name == "in" else self._out_stage[int(name[-1])]
        assert t is not None
        return t.permute(1, 2, 0, 3, 4, 5)

    def _copier(self, name: str, to_gpu: bool) -> list[tuple[int, int, Any]]:
        spans = self._copies.get((name, to_gpu))
        if spans is not None:
            return spans
        other = self._tier(name)
        if self._gpu_stack is not None:
            pieces = [(0, self.num_layers, self._gpu_stack, other)]
        else:
            pieces = [(i, i + 1, c.unsqueeze(0), other[i:i + 1])
                      for i, c in enumerate(self.gpu_caches)]
        if self._triton:
            from pensieve.kernels.launch_swap import BlockCopy

            def make(src: Any, dst: Any) -> Any:
                copy = BlockCopy(src, dst, num_programs=self._num_programs)
                if self._tile_bytes is not None:
                    copy.tile_bytes = self._tile_bytes
                return copy
        else:
            make = _RefCopy
        spans = [(a, b, make(o, g) if to_gpu else make(g, o)) for a, b, g, o in pieces]
        self._copies[(name, to_gpu)] = spans
        return spans

    def _kernel(self, pairs: torch.Tensor, to_gpu: bool, start: int, stop: int,
                tier: str = "host") -> None:
        """Copy ``pairs`` (src, dst) for layers ``[start, stop)`` between the GPU caches and
        ``tier`` (see :attr:`_copies`): towards the GPU if ``to_gpu``."""
        for a, b, copy in self._copier(tier, to_gpu):
            if a < stop and start < b:
                copy(pairs, max(start, a) - a, min(stop, b) - a)
                self.num_copies += 1

    # ------------------------------------------------------------------ staged (hybrid)

    def _grow_out(self, rows: int) -> None:
        """Out-staging halves of at least ``rows`` rows. Replaced halves stay referenced by
        the batches still using them; the new ones are free."""
        if self._out_stage and self._out_stage[0].shape[0] >= rows:
            return
        first = self.gpu_caches[0]
        shape = (rows, self.num_layers, 2, *self.block_shape)
        with torch.inference_mode(False):  # written outside inference mode too (simulator)
            self._out_stage = [torch.empty(shape, dtype=first.dtype, device=self.device)
                               for _ in range(2)]
        self._half_free = [None, None]
        for key in [k for k in self._copies if k[0] in ("out0", "out1")]:
            del self._copies[key]

    def _grow_in(self, rows: int) -> None:
        if self._in_stage is not None and self._in_stage.shape[0] >= rows:
            return
        first = self.gpu_caches[0]
        with torch.inference_mode(False):
            self._in_stage = torch.empty((rows, self.num_layers, 2, *self.block_shape),
                                         dtype=first.dtype, device=self.device)
        self._copies.pop(("in", True), None)

    def _dma_rows(self, stage: torch.Tensor, runs: list[tuple[int, int, int]],
                  to_host: bool) -> None:
        """Copy the runs ``(stage row, CPU block, length)`` between ``stage`` and the host
        tier (both chunk-major: one contiguous piece per run), on the current stream."""
        lengths = [n for _, _, n in runs]
        rows = _Runs([r for r, _, _ in runs], lengths, stage.shape[0]).views(stage)
        host = _Runs([c for _, c, _ in runs], lengths, self.num_cpu_blocks).views(self._host)
        if to_host:
            torch._foreach_copy_(host, rows, non_blocking=True)
        else:
            torch._foreach_copy_(rows, host, non_blocking=True)
        self.num_copies += len(runs)

    def _wait_half_free(self, st: Streams, stream: Any, h: int) -> None:
        """``stream`` waits until the copies out of half ``h`` issued so far are done."""
        if self._half_free[h] is not None:
            st.wait(stream, self._half_free[h])

    def _issue_out_staged(self, st: Streams, pairs: list[tuple[int, int]], gather: Any,
                          dma: Any) -> tuple[Any, list[Any]]:
        """Issue the swap-outs ``pairs`` (gpu, cpu) as gathers on ``gather`` into the staging
        halves and copies to the host on ``dma``, at most :attr:`staging_chunks` per piece;
        returns the event after the last copy and what must stay referenced until then."""
        size = self.staging_chunks
        order = sorted(pairs, key=lambda p: p[1])
        self._grow_out(min(len(order), size))
        idx = st.upload(gather, [(g, j % size) for j, (g, _) in enumerate(order)])
        refs: list[Any] = [idx, *self._out_stage]
        event = None
        for k in range(0, len(order), size):
            piece = order[k:k + size]
            h, self._next_half = self._next_half, self._next_half ^ 1
            self._wait_half_free(st, gather, h)
            st.run(gather, functools.partial(self._kernel, idx[k:k + len(piece)], False, 0,
                                             self.num_layers, f"out{h}"))
            st.wait(dma, st.record(gather))
            runs = runs_of([c for _, c in piece])
            st.run(dma, functools.partial(self._dma_rows, self._out_stage[h], runs, True))
            event = self._half_free[h] = st.record(dma)
        return event, refs

    def _issue_in_staged(self, st: Streams, stream: Any, pairs: list[tuple[int, int]]
                         ) -> list[Any]:
        """Issue the swap-ins ``pairs`` (cpu, gpu) on ``stream``: per piece of at most
        :attr:`staging_chunks`, copies of the runs into the in-staging buffer, then a scatter
        into the GPU caches (one stream: a piece's copies wait for the previous scatter).
        Returns what must stay referenced until the stream's work is done."""
        size = self.staging_chunks
        order = sorted(pairs, key=lambda p: p[0])
        self._grow_in(min(len(order), size))
        assert self._in_stage is not None
        idx = st.upload(stream, [(j % size, g) for j, (_, g) in enumerate(order)])
        for k in range(0, len(order), size):
            piece = order[k:k + size]
            runs = runs_of([c for c, _ in piece])
            st.run(stream, functools.partial(self._dma_rows, self._in_stage, runs, False))
            st.run(stream, functools.partial(self._kernel, idx[k:k + len(piece)], True, 0,
                                             self.num_layers, "in"))
        return [idx, self._in_stage]

    def _compile(self) -> None:
        """Compile the kernel before serving (a first-use compile stalls a step ~1 s): GPU
        block 0 to CPU block 0 and back, which changes no GPU byte (hybrid, staged: through
        the staging buffers too, which allocates them with one row)."""
        assert self._streams is not None
        pairs = torch.zeros(1, 2, dtype=torch.int64, device=self.device)
        layers = self.num_layers
        s = self._streams.in_stream
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            self._kernel(pairs, False, 0, layers)
            self._kernel(pairs, True, 0, 1)
            if self.method in CHUNK_MAJOR:
                self._grow_out(1)
                self._kernel(pairs, False, 0, layers, "out0")
                self._kernel(pairs, False, 0, layers, "out1")
            if self.method == "staged":
                self._grow_in(1)
                self._kernel(pairs, False, 0, layers, "in")  # fills row 0 of the buffer
                self._kernel(pairs, True, 0, layers, "in")
        s.synchronize()
        self.num_copies = 0

    # ------------------------------------------------------------------ synchronous paths

    def _apply(self, obj: Any, to_gpu: bool, layers: range) -> None:
        """Run one list's copies for ``layers`` now (DMA batch or kernel pairs)."""
        if obj is None or not layers:
            return
        if isinstance(obj, _Batch):
            for layer in layers:
                (self._copy_in if to_gpu else self._copy_out)(obj, layer)
        elif isinstance(obj, _Staged):  # every layer at once
            if to_gpu:
                self._issue_in_staged(_IMMEDIATE, None, obj.pairs)
            else:
                self._issue_out_staged(_IMMEDIATE, obj.pairs, None, None)
        else:
            self._kernel(obj, to_gpu, layers.start, layers.stop)

    def _sync_in(self, step: _Step, upto: int) -> None:
        """Synchronous path: run the swap-ins of layers below ``upto`` not run yet (staged:
        all layers at the first call)."""
        if step.next_in_layer < upto:
            if isinstance(step.swap_in, _Staged):
                upto = self.num_layers
            self._apply(step.swap_in, True, range(step.next_in_layer, upto))
            step.next_in_layer = upto

    def _finish_sync(self, step: _Step | None) -> None:
        if step is None:
            return
        if self._stream is not None:
            self._stream.synchronize()
            return
        with torch.inference_mode():
            self._sync_in(step, self.num_layers)
            self._apply(step.swap_out, False, range(self.num_layers))

    def _start_dma_cuda(self, plan: SwapPlan) -> LayerReady | None:
        assert self._stream is not None
        compute = torch.cuda.current_stream(self.device)
        compute_done = torch.cuda.Event()
        compute_done.record(compute)
        with torch.cuda.stream(self._stream):
            step = self._prepare(plan)  # index uploads go on the copy stream
            self._stream.wait_event(compute_done)
            for layer in range(self.num_layers):
                self._copy_out(step.out_first, layer)
            events: list[torch.cuda.Event] = []
            if step.swap_in is not None:
                for layer in range(self.num_layers):
                    self._copy_in(step.swap_in, layer)
                    events.append(torch.cuda.Event())
                    events[-1].record(self._stream)
            elif step.out_first is not None:
                events.append(torch.cuda.Event())
                events[-1].record(self._stream)
                events *= self.num_layers
            for layer in range(self.num_layers):
                self._copy_out(step.swap_out, layer)
        step.events = events
        self._step = step
        if not events:
            return None

        def layer_ready(i: int) -> None:
            self._check_layer(i)
            torch.cuda.current_stream(self.device).wait_event(events[i])

        return layer_ready

    # ------------------------------------------------------------------ plans

    def _check_layer(self, i: int) -> None:
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer {i} not in [0, {self.num_layers})")

    def _count(self, plan: SwapPlan) -> None:
        n_out = len(plan.swap_out_first) + len(plan.swap_out)
        self.bytes_out += n_out * self.num_layers * self.block_bytes
        self.bytes_in += len(plan.swap_in) * self.num_layers * self.block_bytes

    def _validate(self, plan: SwapPlan) -> None:
        self._check_pairs(plan.swap_out_first, "swap_out_first", gpu_first=True)
        self._check_pairs(plan.swap_in, "swap_in", gpu_first=False)
        self._check_pairs(plan.swap_out, "swap_out", gpu_first=True)

    def _check_pairs(self, pairs: Sequence[tuple[int, int]], what: str, gpu_first: bool) -> None:
        if not pairs:
            return
        gpu = [p[0] if gpu_first else p[1] for p in pairs]
        cpu = [p[1] if gpu_first else p[0] for p in pairs]
        if min(gpu) < 0 or max(gpu) >= self.num_gpu_blocks:
            raise ValueError(f"{what}: GPU block out of range [0, {self.num_gpu_blocks})")
        if min(cpu) < 0 or max(cpu) >= self.num_cpu_blocks:
            raise ValueError(f"{what}: CPU block out of range [0, {self.num_cpu_blocks})")
        if len(set(gpu)) != len(gpu) or len(set(cpu)) != len(cpu):
            raise ValueError(f"{what}: repeated GPU or CPU block")

    def _prepare(self, plan: SwapPlan) -> _Step:
        """Synchronous and DMA paths: validate, then batch the three lists (DMA: runs and
        staging, grown to the largest list; kernel: pair tensors)."""
        self._validate(plan)
        if self.method in STREAM_METHODS:
            def t(pairs: list[tuple[int, int]]) -> torch.Tensor | None:
                return torch.tensor(pairs, dtype=torch.int64) if pairs else None

            def staged(pairs: list[tuple[int, int]]) -> _Staged | None:
                return _Staged(list(pairs)) if pairs else None

            chunk_major = self.method in CHUNK_MAJOR
            step = _Step(t(plan.swap_out_first),
                         staged(plan.swap_in) if self.method == "staged" else t(plan.swap_in),
                         staged(plan.swap_out) if chunk_major else t(plan.swap_out))
        else:
            out_first = self._batch([(g, c) for g, c in plan.swap_out_first])
            swap_in = self._batch([(g, c) for c, g in plan.swap_in])
            swap_out = self._batch([(g, c) for g, c in plan.swap_out])
            staged = [b.n for b in (out_first, swap_in, swap_out)
                      if b is not None and b.gpu is None]
            need = 2 * max(staged, default=0) * self.gpu_caches[0][0, 0].numel()
            if need > self._staging.numel():
                self._staging = torch.empty(need, dtype=self._staging.dtype, device=self.device)
            step = _Step(out_first, swap_in, swap_out)
        self._count(plan)
        return step

    def _batch(self, pairs: Sequence[tuple[int, int]]) -> _Batch | None:
        """``pairs``: (gpu_block, cpu_block), validated. Sorted by CPU block, cut into
        maximal runs."""
        if not pairs:
            return None
        pairs = sorted(pairs, key=lambda p: p[1])
        gpu = [g for g, _ in pairs]
        cpu = [c for _, c in pairs]
        rows = [0]  # first row of each run
        direct = True
        for j in range(1, len(pairs)):
            if cpu[j] != cpu[j - 1] + 1:
                rows.append(j)
            elif gpu[j] != gpu[j - 1] + 1:
                direct = False
        lengths = [b - a for a, b in zip(rows, [*rows[1:], len(pairs)], strict=True)]
        cpu_runs = _Runs([cpu[r] for r in rows], lengths, self.num_cpu_blocks)
        if direct:
            gpu_runs = _Runs([gpu[r] for r in rows], lengths, self.num_gpu_blocks)
            return _Batch(len(pairs), cpu_runs, gpu_runs, None, None, len(rows))
        index = torch.tensor(gpu, dtype=torch.int64, pin_memory=self._cuda)
        index = index.to(self.device, non_blocking=True)
        stage = _Runs(rows, lengths, len(pairs))
        return _Batch(len(pairs), cpu_runs, None, stage, index, len(rows))

    def _stage(self, n: int) -> torch.Tensor:
        """``[2, n, chunk_size, num_kv_heads, head_dim]`` contiguous view of the staging buffer."""
        return self._staging[: 2 * n * self.gpu_caches[0][0, 0].numel()].view(
            2, n, *self.block_shape
        )

    def _copy_out(self, b: _Batch | None, layer: int) -> None:
        """DMA: GPU -> CPU copies of one layer (on the current stream)."""
        if b is None:
            return
        gpu, cpu = self.gpu_caches[layer], self.cpu_caches[layer]
        if b.gpu is not None:
            src = b.gpu.views(gpu[0]) + b.gpu.views(gpu[1])
        else:
            assert b.stage is not None and b.index is not None
            buf = self._stage(b.n)  # [2, n, C, Hkv, D]
            torch.index_select(gpu, 1, b.index, out=buf)
            src = b.stage.views(buf[0]) + b.stage.views(buf[1])
        dst = b.cpu.views(cpu[0]) + b.cpu.views(cpu[1])
        torch._foreach_copy_(dst, src, non_blocking=True)
        self.num_copies += len(dst)

    def _copy_in(self, b: _Batch | None, layer: int) -> None:
        """DMA: CPU -> GPU copies of one layer (on the current stream)."""
        if b is None:
            return
        gpu, cpu = self.gpu_caches[layer], self.cpu_caches[layer]
        src = b.cpu.views(cpu[0]) + b.cpu.views(cpu[1])
        if b.gpu is not None:
            dst = b.gpu.views(gpu[0]) + b.gpu.views(gpu[1])
            torch._foreach_copy_(dst, src, non_blocking=True)
        else:
            assert b.stage is not None and b.index is not None
            buf = self._stage(b.n)  # [2, n, C, Hkv, D]
            dst = b.stage.views(buf[0]) + b.stage.views(buf[1])
            torch._foreach_copy_(dst, src, non_blocking=True)
            gpu.index_copy_(1, b.index, buf)
        self.num_copies += len(dst)


class _RefCopy:
    """The kernel's torch reference with :class:`~pensieve.kernels.launch_swap.BlockCopy`'s
    call signature (the kernel method on the CPU without Triton's interpreter)."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.src, self.dst = src, dst
        self.num_programs = 1
        self.tile_bytes = 0

    def __call__(self, pairs: torch.Tensor, start: int, stop: int) -> None:
        from pensieve.kernels.reference import swap_blocks_ref

        swap_blocks_ref(self.src[start:stop], self.dst[start:stop], pairs)


def _stacked(caches: list[torch.Tensor]) -> torch.Tensor | None:
    """``[L, 2, N, C, Hkv, D]`` view of per-layer caches that are evenly spaced views of one
    storage (``allocate_kv_caches``), else None."""
    first = caches[0]
    if len(caches) == 1:
        return first.unsqueeze(0)
    esize = first.element_size()
    step = caches[1].data_ptr() - first.data_ptr()
    if step <= 0 or step % esize:
        return None
    storage = first.untyped_storage().data_ptr()
    for i, c in enumerate(caches):
        if (c.untyped_storage().data_ptr() != storage
                or c.data_ptr() != first.data_ptr() + i * step):
            return None
    last_end = caches[-1].storage_offset() + caches[-1].numel()
    if last_end > first.untyped_storage().nbytes() // esize:
        return None
    return first.as_strided((len(caches), *first.shape), (step // esize, *first.stride()))

