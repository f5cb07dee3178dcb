"""The disk tier's write side: spilled chunks' bytes in pooled buffers, and who may read them.

A step that spills chunks to disk copies each spilled block's KV over all layers
(``[L, 2, C, Hkv, D]``, ``block_bytes``) out of its tier into a write buffer
(:func:`copy_out`) before the step runs, and queues it for the writer thread
(:class:`WriteBuffers`). A fresh buffer's pages are faulted in as the copy fills it (a buffer
of megabytes is a fresh anonymous mapping, unmapped again when freed): on the development VM
a step of 150 chunks of 4 MiB spent most of its copy in those faults (docs/performance.md,
"The disk tier's spills: pooled write buffers"). So a buffer whose write is done (or skipped)
goes back to an idle pool, at most ``WRITE_SPARE_BYTES`` of them, and is filled again by a
later step; the disk tier's refill thread makes buffers ahead of the steps
(``WRITE_READY_BYTES``), pageable. The shared store's buffers (``--kv-remote``) are pinned on
CUDA, so a GPU block's bytes come over in one DMA each.

Ownership, the invariant: a buffer is idle (in the pool; only :meth:`WriteBuffers.take` hands
it out, on the thread that runs the steps) or owned by its write. While the write is queued
its bytes may be lent (:meth:`WriteBuffers.lend`: a read of its file, whose payload may then
stay in memory and be restored later, or a restore in the step itself). A lent buffer never
goes back to the pool: the borrower keeps it, and it is freed when its last view goes. ``lend``
and the writer's :meth:`WriteBuffers.done` hold the same lock, so either the lending comes
first (and the write, once done, leaves its buffer to the borrower) or the write has left the
queue (and nothing can be lent from it any more).
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import torch

from pensieve.core.disk_index import DiskEntry

_T = TypeVar("_T")

COPY_THREADS = 8
"""Threads that copy a step's spilled chunks out of the CPU tier and its restored chunks into
it (host copies of a block each, the GIL released): on the step path, so a step that spills
and restores a few hundred 4 MiB chunks takes a fraction of what one thread would."""

PARALLEL_COPIES = 4
"""Fewer copies than this in a step run on the step's thread (a thread pool's hand-off would
cost more than it saves)."""


def copy_pool(threads: int = COPY_THREADS) -> ThreadPoolExecutor:
    """The thread pool a disk tier copies its chunks with (:func:`copy_out`, :func:`copy_in`)."""
    return ThreadPoolExecutor(threads, thread_name_prefix="pensieve-disk-copy")


def each(pool: ThreadPoolExecutor | None, fn: Callable[[_T], object], items: Sequence[_T]) -> None:
    """``fn`` of every item, on ``pool``'s threads when there are enough of them (None: here);
    done when this returns (the first error raised)."""
    if pool is None or len(items) < PARALLEL_COPIES:
        for x in items:
            fn(x)
    else:
        for _ in pool.map(fn, items):
            pass


WRITE_SPARE_BYTES = 1 << 30
"""At most this many bytes of idle write buffers are kept for reuse (and at least one)."""

WRITE_READY_BYTES = 1 << 30
"""A disk tier's refill thread keeps this many bytes of idle write buffers ready (at most an
eighth of its CPU tier), their pages faulted in off the step path. Without it, a burst of
spills past the pool made fresh buffers on the step: on an H100 host, 156 fresh pinned 4 MiB
buffers took 0.643 s of one step (4 ms each, docs/benchmarks.md)."""


@dataclass(eq=False)
class QueuedWrite:
    """One chunk's write, queued or running."""

    entry: DiskEntry
    buf: torch.Tensor
    """``[block_bytes]`` uint8: the chunk's bytes, ``[L, 2, C, Hkv, D]``."""
    payload: memoryview
    """The same bytes, for the writer (and for a borrower)."""
    lent: bool = False
    """Its bytes were handed to a reader or a restore: ``buf`` is theirs once written."""


class WriteBuffers:
    """The write buffers of one disk tier: the idle pool and the writes queued, by file name.
    Thread-safe (one lock); buffers are taken by the step's thread only."""

    def __init__(self, block_bytes: int, pin: bool, ready: int = 0) -> None:
        """``pin``: page-locked buffers made on the step (the device cache is CUDA).
        ``ready``: idle buffers a refill thread keeps made ahead (pageable, pages faulted in;
        at most the pool's bound; 0: none, every buffer made when taken)."""
        self.block_bytes = block_bytes
        self.pin = pin
        self.spare_max = max(1, WRITE_SPARE_BYTES // block_bytes)
        self.ready = min(ready, self.spare_max)
        self.allocated = 0
        """Buffers made fresh on the step so far (not taken from the pool)."""
        self.made_ahead = 0
        """Buffers the refill thread made."""
        self.taken = 0
        """Buffers taken by :meth:`take` (a step's spills' copies)."""
        self.queued_bytes = 0
        self._idle: list[torch.Tensor] = []
        self._queued: dict[str, QueuedWrite] = {}
        self._lock = threading.Lock()
        self._refill = ThreadPoolExecutor(1, thread_name_prefix="pensieve-disk-buf") \
            if self.ready else None
        self._refilling = self._closed = False
        self._top_up()

    @property
    def idle(self) -> int:
        return len(self._idle)

    def take(self, n: int) -> list[torch.Tensor]:
        """``n`` buffers of ``[block_bytes]`` uint8: idle ones first, then fresh ones."""
        bufs = self.take_idle(n)
        fresh = n - len(bufs)
        self.allocated += fresh
        self.taken += n
        return bufs + [torch.empty(self.block_bytes, dtype=torch.uint8, pin_memory=self.pin)
                       for _ in range(fresh)]

    def take_idle(self, n: int, keep: int = 0) -> list[torch.Tensor]:
        """At most ``n`` idle buffers, leaving ``keep`` idle (none made: what is idle now)."""
        with self._lock:
            k = max(0, min(n, len(self._idle) - keep))
            bufs = self._idle[len(self._idle) - k:]
            del self._idle[len(self._idle) - k:]
        self._top_up()
        return bufs

    def put_back(self, buf: torch.Tensor) -> None:
        """A buffer taken and not written: idle again."""
        with self._lock:
            self._give(buf)

    def _top_up(self) -> None:
        """Start the refill thread if the pool has fewer than ``ready`` idle buffers."""
        if self._refill is None:
            return
        with self._lock:
            if self._refilling or self._closed or len(self._idle) >= self.ready:
                return
            self._refilling = True
        self._refill.submit(self._fill)

    def _fill(self) -> None:
        """Make buffers until ``ready`` are idle (the refill thread; ``fill_`` faults their
        pages in with the GIL released)."""
        try:
            while True:
                with self._lock:
                    if self._closed or len(self._idle) >= self.ready:
                        return
                buf = torch.empty(self.block_bytes, dtype=torch.uint8)
                buf.fill_(0)
                with self._lock:
                    self._idle.append(buf)
                    self.made_ahead += 1
        finally:
            with self._lock:
                self._refilling = False

    def queue(self, entry: DiskEntry, buf: torch.Tensor, backlog: int) -> QueuedWrite | None:
        """Queue ``entry``'s write of ``buf`` unless ``backlog`` bytes would then wait for the
        writer (None: skipped, ``buf`` back in the pool)."""
        with self._lock:
            if self.queued_bytes + self.block_bytes > backlog:
                self._give(buf)
                return None
            self.queued_bytes += self.block_bytes
            write = QueuedWrite(entry, buf, memoryview(buf.numpy()))  # type: ignore[arg-type]
            self._queued[entry.name] = write
            return write

    def lend(self, entry: DiskEntry) -> memoryview | None:
        """The bytes of ``entry``'s queued write (None: none queued); its buffer is the
        caller's from now on, never pooled again."""
        with self._lock:
            write = self._queued.get(entry.name)
            if write is None or write.entry is not entry:
                return None
            write.lent = True
            return write.payload

    def done(self, write: QueuedWrite) -> None:
        """The writer is done with ``write`` (written or failed): it leaves the queue, and
        its buffer goes back to the pool unless it was lent."""
        with self._lock:
            self.queued_bytes -= self.block_bytes
            if self._queued.get(write.entry.name) is write:
                del self._queued[write.entry.name]
            if not write.lent:
                self._give(write.buf)

    def writing(self, name: str) -> bool:
        """Whether a write of file ``name`` is queued or running."""
        with self._lock:
            return name in self._queued

    def clear(self) -> None:
        """Stop the refill thread and let the idle buffers go (the tier is closed)."""
        with self._lock:
            self._closed = True
        if self._refill is not None:
            self._refill.shutdown(wait=True)
        with self._lock:
            self._idle.clear()

    def _give(self, buf: torch.Tensor) -> None:
        if len(self._idle) < self.spare_max:
            self._idle.append(buf)


class AheadCopies:
    """A step's copies of the chunks it writes ahead of their spills (``DiskPlan.ahead``):
    each CPU block's bytes into a write buffer, on the copy pool beside the step's compute,
    in at most one task per pool thread. :meth:`wait` (before the next step's plan is
    carried out, a read, or the end) waits for them and hands each buffer on."""

    def __init__(self, pool: ThreadPoolExecutor, cpu_caches: list[torch.Tensor],
                 cpu_blocks: torch.Tensor | None, threads: int = COPY_THREADS) -> None:
        self._pool = pool
        self._cpu_caches = cpu_caches
        self._cpu_blocks = cpu_blocks
        self._threads = threads
        self._running: list[tuple[list[tuple[DiskEntry, torch.Tensor]], Future[None]]] = []
        self.copied = 0
        """Chunks copied so far."""

    def __len__(self) -> int:
        return sum(len(items) for items, _ in self._running)

    def start(self, items: list[tuple[int, DiskEntry]], bufs: list[torch.Tensor]) -> None:
        """Copy ``items[i]`` = (cpu_block, entry) into ``bufs[i]`` (returns at once)."""
        n = len(bufs)
        self.copied += n
        per = max(1, -(-n // self._threads))
        for at in range(0, n, per):
            part = [(False, b, e) for b, e in items[at:at + per]]
            out = bufs[at:at + per]
            fut = self._pool.submit(copy_out, part, out, self._cpu_caches, [], self._cpu_blocks)
            self._running.append(([(e, buf) for (_, _, e), buf in zip(part, out)], fut))

    def wait(self, then: Callable[[DiskEntry, torch.Tensor], None]) -> None:
        """Wait for every copy started; ``then(entry, buf)`` for each, in order."""
        running, self._running = self._running, []
        for items, fut in running:
            fut.result()
            for entry, buf in items:
                then(entry, buf)


def copy_out(spills: list[tuple[bool, int, DiskEntry]], bufs: list[torch.Tensor],
             cpu_caches: list[torch.Tensor], gpu_caches: list[torch.Tensor],
             cpu_blocks: torch.Tensor | None, pool: ThreadPoolExecutor | None = None) -> None:
    """Copy each spilled block's K and V over all layers, ``[L, 2, C, Hkv, D]``, into its
    buffer (``bufs[i]``: ``[block_bytes]`` uint8, for ``spills[i]`` = (from_gpu, block, entry)),
    done when this returns. Per layer the caches are ``[2, num_blocks, C, Hkv, D]``;
    ``cpu_blocks``: the CPU tier as ``[num_cpu_blocks, L * 2 * C * Hkv * D]`` when it is
    chunk-major (one copy per block), else None (one copy of all layers per block). A CUDA
    cache's blocks are gathered on the device (one ``index_select`` per layer) and each row
    copied into its buffer (asynchronously into a pinned one), then the stream is waited for.
    Host copies run on ``pool`` (:func:`each`)."""
    for gpu in (False, True):
        at = [i for i, (g, _, _) in enumerate(spills) if g == gpu]
        if not at:
            continue
        caches = gpu_caches if gpu else cpu_caches
        dtype = caches[0].dtype
        shape = (len(caches), *caches[0][:, 0].shape)  # [L, 2, C, Hkv, D]
        device = caches[0].device
        if device.type != "cpu":
            idx = torch.tensor([spills[i][1] for i in at], device=device)
            kv = torch.stack([c.index_select(1, idx) for c in caches])  # [L, 2, n, C, Hkv, D]
            rows = kv.movedim(2, 0).contiguous().view(len(at), -1)  # [n, L * 2 * C * Hkv * D]
            for j, i in enumerate(at):
                bufs[i].view(dtype).copy_(rows[j], non_blocking=bufs[i].is_pinned())
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
        elif not gpu and cpu_blocks is not None:
            each(pool, partial(_row_out, spills, bufs, cpu_blocks, dtype), at)
        else:
            each(pool, partial(_layers_out, spills, bufs, caches, dtype, shape), at)


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for two contiguous host tensors of the same bytes, as one
    ``memmove`` on this thread (the GIL released): a torch copy of megabytes splits itself
    over torch's intra-op threads, and the copy pool's threads each doing so would start a
    team of them apiece (8 x 16 threads on a 16-core host)."""
    n = dst.numel() * dst.element_size()
    if not (dst.is_contiguous() and src.is_contiguous()) or \
            n != src.numel() * src.element_size() or dst.device.type != "cpu" or \
            src.device.type != "cpu":
        raise ValueError("host_copy: two contiguous host tensors of the same size")
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)


def _row_out(spills: list[tuple[bool, int, DiskEntry]], bufs: list[torch.Tensor],
             rows: torch.Tensor, dtype: torch.dtype, i: int) -> None:
    host_copy(bufs[i], rows[spills[i][1]])


def _layers_out(spills: list[tuple[bool, int, DiskEntry]], bufs: list[torch.Tensor],
                caches: list[torch.Tensor], dtype: torch.dtype, shape: tuple[int, ...],
                i: int) -> None:
    block = spills[i][1]
    torch.stack([c[:, block] for c in caches], out=bufs[i].view(dtype).view(shape))


def copy_in(restores: list[tuple[memoryview, int]], cpu_caches: list[torch.Tensor],
            cpu_blocks: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
            pool: ThreadPoolExecutor | None = None) -> None:
    """Copy each chunk's payload (``[L, 2, C, Hkv, D]``) into its CPU block, for
    ``restores[i]`` = (payload, block): one contiguous copy on a chunk-major tier
    (``cpu_blocks``, as for :func:`copy_out`), else one per layer; on ``pool`` (:func:`each`),
    done when this returns."""
    def one(item: tuple[memoryview, int]) -> None:
        payload, block = item
        view = torch.frombuffer(payload, dtype=torch.uint8).view(dtype)
        if cpu_blocks is not None:
            host_copy(cpu_blocks[block], view)
            return
        kv = view.view(shape)
        for layer, cache in enumerate(cpu_caches):
            cache[:, block].copy_(kv[layer])
    each(pool, one, restores)


def chunk_major_blocks(cpu_caches: list[torch.Tensor]) -> torch.Tensor | None:
    """The CPU tier as ``[num_cpu_blocks, L * 2 * C * Hkv * D]`` (each row one block's KV over
    all layers, contiguous) when ``cpu_caches``, per layer ``[2, num_cpu_blocks, C, Hkv, D]``,
    are the layer views of one chunk-major ``[num_cpu_blocks, L, 2, C, Hkv, D]`` tensor
    (:func:`~pensieve.runner.swap_copies.allocate_host_tier`); else None."""
    if not cpu_caches or cpu_caches[0].device.type != "cpu":
        return None
    first = cpu_caches[0]
    two, num_blocks, *inner = first.shape
    per_layer = two * math.prod(inner)  # elements of one layer of one block
    block = per_layer * len(cpu_caches)
    size = math.prod(inner)
    want = (size, block, *torch.empty(inner, device="meta").stride())
    storage = first.untyped_storage().data_ptr()
    for layer, c in enumerate(cpu_caches):
        if (c.shape != first.shape or c.dtype != first.dtype or c.stride() != want
                or c.untyped_storage().data_ptr() != storage
                or c.data_ptr() != first.data_ptr() + layer * per_layer * c.element_size()):
            return None
    return first.as_strided((num_blocks, block), (block, 1))
