"""The CPU tier of the KV cache and the copies between it and the GPU tier.

Owns one host tensor per layer, ``[2, num_cpu_blocks, chunk_size, num_kv_heads, head_dim]``
(K then V, the GPU caches' layout and dtype), and executes each step's :class:`SwapPlan`.

Ordering. One step's copies are issued in the order :class:`SwapPlan` documents, and each copy
touches a single layer, so for every layer the three lists apply one after the other::

    swap_out_first (all layers) -> swap_in (layer 0, 1, ...) -> swap_out (all layers)

A GPU block may be both a ``swap_out_first`` source and a ``swap_in`` destination (its old
content reaches the CPU first); a CPU block may be both a ``swap_in`` source and a ``swap_out``
destination (it is read first). Within one list, GPU ids and CPU ids must be distinct.

CUDA. All copies run on one dedicated copy stream, so GPU-to-CPU copies wait behind swap-ins
(PCIe contention: swap-in first). The copy stream first waits for an event recorded on the
current (compute) stream in :meth:`KVSwapper.start_step`: copies never read a block before the
compute stream's earlier writes to it are done, nor overwrite one it may still read. An event
is recorded after each layer's swap-ins; ``layer_ready(i)`` makes the compute stream wait on
layer i's event (which follows every ``swap_out_first`` copy too), so layer i's attention sees
its swapped-in KV and never writes a block before its old content is copied out. Background
``swap_out`` sources are blocks nothing writes during the step. :meth:`KVSwapper.finish_step`
blocks the host until the copy stream is idle. Staging buffers and index tensors are allocated
on the copy stream and only used there (or kept referenced until ``finish_step``).

Bandwidth. Copies are batched per layer: a swap-out gathers its GPU blocks with one
``index_select`` into a device staging buffer ``[2, n, chunk_size, num_kv_heads, head_dim]``,
then copies each maximal run of consecutive CPU block ids with one copy for K and one for V; a
swap-in does the reverse (copies per CPU run into staging, one ``index_copy_``). When every CPU
run is also a run of consecutive GPU ids, the copies go straight between the tiers instead.

The host tier is pinned (page-locked with ``cudaHostRegister``, exact size) when the GPU caches
are on CUDA. When they are on the CPU the same code runs without streams: ``swap_out_first``
at ``start_step``, layer i's swap-ins at ``layer_ready(i)`` (so a caller that forgets to call
it reads stale KV on the CPU as well), the rest at ``finish_step``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pensieve.core.outputs import SwapPlan

LayerReady = Callable[[int], None]


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
    """One list of a plan, sorted by CPU block and cut into runs of consecutive CPU ids."""

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
    """Copies of the step in flight, kept referenced until :meth:`KVSwapper.finish_step`."""

    out_first: _Batch | None
    swap_in: _Batch | None
    swap_out: _Batch | None
    next_in_layer: int = 0
    """Host path only: first layer whose swap-ins have not run yet."""
    events: list[torch.cuda.Event] | None = None


class KVSwapper:
    """The CPU tier plus the step's swap copies (see the module docstring for the rules).

    ``gpu_caches``: one ``[2, num_gpu_blocks, chunk_size, num_kv_heads, head_dim]`` tensor per
    layer (K then V), as ``allocate_kv_caches`` makes them. ``num_cpu_blocks`` may be 0 (no
    CPU tier; only empty plans then).
    """

    def __init__(self, gpu_caches: list[torch.Tensor], num_cpu_blocks: int) -> None:
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
        shape = (2, num_cpu_blocks, *self.block_shape)
        self._host = torch.empty((self.num_layers, *shape), dtype=first.dtype)
        self.pinned = self._cuda and self._host.numel() > 0
        """Whether the CPU tier is page-locked (needed for asynchronous copies)."""
        if self.pinned:
            _register(self._host)
            weakref.finalize(self, _unregister, self._host)
        self.cpu_caches: list[torch.Tensor] = list(self._host.unbind(0))
        """One ``[2, num_cpu_blocks, chunk_size, num_kv_heads, head_dim]`` tensor per layer."""
        # High priority: the swap-in scatter kernels should not queue behind compute kernels.
        self._stream = torch.cuda.Stream(self.device, priority=-1) if self._cuda else None
        self._staging = torch.empty(0, dtype=first.dtype, device=self.device)
        self._step: _Step | None = None
        self.bytes_in = 0
        """Cumulative bytes copied CPU -> GPU (K and V, all layers)."""
        self.bytes_out = 0
        """Cumulative bytes copied GPU -> CPU."""
        self.num_copies = 0
        """Cumulative host<->device copy calls issued (two per run per layer: K and V)."""

    # ------------------------------------------------------------------ step API

    @torch.inference_mode()
    def start_step(self, plan: SwapPlan) -> LayerReady | None:
        """Issue the plan's copies; returns the ``layer_ready`` callback, or None if no wait.

        On CUDA every copy is enqueued on the copy stream before this returns (the host does
        not wait); the callback makes the *current* stream wait for layer i. A step still in
        flight is finished first.
        """
        if self._step is not None:
            self.finish_step()
        if plan.is_empty:
            return None
        if self._cuda:
            return self._start_cuda(plan)
        step = self._prepare(plan)
        for layer in range(self.num_layers):
            self._copy_out(step.out_first, layer)
        self._step = step
        if step.swap_in is None:
            return None

        def layer_ready(i: int) -> None:
            self._check_layer(i)
            with torch.inference_mode():
                while step.next_in_layer <= i:
                    self._copy_in(step.swap_in, step.next_in_layer)
                    step.next_in_layer += 1

        return layer_ready

    def finish_step(self) -> None:
        """Block until every copy of the step is complete (no-op when none is in flight)."""
        step, self._step = self._step, None
        if step is None:
            return
        if self._stream is not None:
            self._stream.synchronize()
            return
        with torch.inference_mode():
            while step.next_in_layer < self.num_layers:
                self._copy_in(step.swap_in, step.next_in_layer)
                step.next_in_layer += 1
            for layer in range(self.num_layers):
                self._copy_out(step.swap_out, layer)

    # ------------------------------------------------------------------ internals

    def _start_cuda(self, plan: SwapPlan) -> LayerReady | None:
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

    def _check_layer(self, i: int) -> None:
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer {i} not in [0, {self.num_layers})")

    def _prepare(self, plan: SwapPlan) -> _Step:
        """Validate and batch the three lists; grow the staging buffer to the largest."""
        out_first = self._batch([(g, c) for g, c in plan.swap_out_first], "swap_out_first")
        swap_in = self._batch([(g, c) for c, g in plan.swap_in], "swap_in")
        swap_out = self._batch([(g, c) for g, c in plan.swap_out], "swap_out")
        staged = [b.n for b in (out_first, swap_in, swap_out) if b is not None and b.gpu is None]
        need = 2 * max(staged, default=0) * self.gpu_caches[0][0, 0].numel()
        if need > self._staging.numel():
            self._staging = torch.empty(need, dtype=self._staging.dtype, device=self.device)
        n_out = len(plan.swap_out_first) + len(plan.swap_out)
        self.bytes_out += n_out * self.num_layers * self.block_bytes
        self.bytes_in += len(plan.swap_in) * self.num_layers * self.block_bytes
        return _Step(out_first, swap_in, swap_out)

    def _batch(self, pairs: Sequence[tuple[int, int]], what: str) -> _Batch | None:
        """``pairs``: (gpu_block, cpu_block). Sorted by CPU block, cut into maximal runs."""
        if not pairs:
            return None
        pairs = sorted(pairs, key=lambda p: p[1])
        gpu = [g for g, _ in pairs]
        cpu = [c for _, c in pairs]
        if min(gpu) < 0 or max(gpu) >= self.num_gpu_blocks:
            raise ValueError(f"{what}: GPU block out of range [0, {self.num_gpu_blocks})")
        if cpu[0] < 0 or cpu[-1] >= self.num_cpu_blocks:
            raise ValueError(f"{what}: CPU block out of range [0, {self.num_cpu_blocks})")
        if len(set(gpu)) != len(gpu) or len(set(cpu)) != len(cpu):
            raise ValueError(f"{what}: repeated GPU or CPU block")
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
        """GPU -> CPU copies of one layer (on the current stream)."""
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
        """CPU -> GPU copies of one layer (on the current stream)."""
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


def _register(t: torch.Tensor) -> None:
    """Page-lock a host tensor in place: exact size, unlike ``pin_memory=True`` whose caching
    allocator rounds every allocation up to a power of two (up to 2x the host RAM)."""
    nbytes = t.numel() * t.element_size()
    err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister({nbytes / 2**30:.1f} GiB CPU tier): error {err}")


def _unregister(t: torch.Tensor) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    except Exception:  # interpreter shutdown: the process releases the memory anyway
        pass
