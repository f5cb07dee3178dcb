"""The disk tier's I/O: chunks between CPU-tier blocks and files, off the step's path.

The cache decides (:class:`~pensieve.core.disk_index.DiskIndex`); this module does, for the
:class:`~pensieve.engine.engine_core.EngineCore` at three points of its life:

- ``prefetch(conversation_id, tokens, salt)`` when a turn is added: the files it may restore
  (the conversation's own, and its leading full chunks' by hash) are read and checked
  (:mod:`pensieve.engine.disk_files`) in a thread pool, their payloads kept in memory;
- ``collect()`` before the scheduler runs: finished reads mark their entries ready (or
  forget them: a bad file is recomputed); failed writes forget theirs;
- ``apply(plan)`` between scheduling and execution, ``plan`` the step's
  :attr:`~pensieve.core.outputs.SchedulerOutput.disk`: each spilled block's bytes are copied
  out of its tier into a pooled write buffer
  (:mod:`pensieve.engine.disk_writes`: buffers already filled before, so no fresh pages to
  fault in; pinned on CUDA; before any copy of the step touches the blocks; the step waits
  for this copy, not for the write) and written by one writer thread (writes and deletes in
  plan order), the buffer going back to the pool once written unless its bytes were lent
  to a read or a restore meanwhile; each restored chunk's verified payload is copied into
  its CPU block (the step's swap-ins then move it to the GPU; the payload is kept for other
  turns, within RESTORED_LOADED_BYTES), and dropped files are deleted.

No step waits for a disk write. A step waits for reads still running (they started when their
turns were added) only when no request runs; otherwise the turns waiting for them
(``DiskIndex.reading``) are passed over by the scheduler until they are done. On CUDA, a step
with disk copies first waits for the background swap-outs still in flight (a spilled block
may be one's destination).

``close()`` (the engine's shutdown) writes every idle conversation's GPU and CPU chunks that
are not on disk yet (a chunk shared by several conversations, or already on disk under its
hash, is written once) and waits for the writer, so a restarted server with the same path and
conversation store resumes them from disk. A write that fails (disk full, path gone) is
logged and its chunk is simply dropped, as without a disk tier.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from pensieve.config import CacheConfig
from pensieve.core.disk_index import (
    DiskEntry,
    DiskIndex,
    found_key,
    require_cpu_tier,
    spill_idle,
)
from pensieve.core.disk_restore import worth_reading
from pensieve.core.outputs import DiskPlan
from pensieve.core.tiered_cache import TieredKVCache
from pensieve.engine import disk_files
from pensieve.engine.disk_writes import QueuedWrite, WriteBuffers, copy_out

log = logging.getLogger("pensieve")

WRITE_BACKLOG_BYTES = 8 << 30
"""At most this many bytes wait for the writer (host memory); past it a spilled chunk is
dropped, as without a disk tier (a disk slower than the spills must not grow memory)."""

UNHELD_LOADED_BYTES = 8 << 30
"""At most this many bytes of verified payloads not restored yet of entries no conversation
holds (read by hash for a turn, or left over after an admission took its chunk from the GPU)
wait in memory; past it the oldest are let go (not ready: read again, or recomputed)."""

RESTORED_LOADED_BYTES = 1 << 30
"""At most this many bytes of payloads already restored are kept in memory (most recently
restored first), so that other turns restore the same chunk (a shared prompt after a
restart) without reading it again."""

READ_THREADS = 16
"""Reader threads of the engine's disk tier: on the H200 host the tier read 7.94 GB/s with 16
readers against 3.63 GB/s with 4 (docs/performance.md, "Rerun on the H200 host after the
read-path change"); a step's prefetches overlap, so their aggregate rate is what turns see."""

SPARE_BYTES = 1 << 30
"""At most this many bytes of read buffers are kept for reuse (and at least 4 per reader)."""


class DiskTier:
    """Files of one directory, read into and written from the CPU tier's blocks."""

    def __init__(self, path: str, capacity_chunks: int, chunk_size: int, fingerprint: str,
                 cpu_caches: list[torch.Tensor], gpu_caches: list[torch.Tensor],
                 read_gbps: float | None = None, measure: bool = True,
                 read_threads: int = READ_THREADS) -> None:
        """``cpu_caches`` / ``gpu_caches``: per layer ``[2, num_blocks, C, Hkv, D]`` (the CPU
        tier and the device cache). ``read_gbps``: the disk's read rate for the
        read-or-recompute choice; None: measured on the reads if ``measure`` (until the first
        one, always read), else always read."""
        disk_files.check_writable(path)
        self.path = path
        self.fingerprint = fingerprint
        self.cpu_caches = cpu_caches
        self.gpu_caches = gpu_caches
        layer = cpu_caches[0][:, 0] if cpu_caches else gpu_caches[0][:, 0]
        self.shape = (len(cpu_caches or gpu_caches), *layer.shape)
        self.dtype = layer.dtype
        self.block_bytes = layer.numel() * layer.element_size() * self.shape[0]
        self.index = DiskIndex(capacity_chunks, chunk_size)
        self._measure = measure and read_gbps is None
        if read_gbps is not None:
            self.index.read_chunk_s = self.block_bytes / (read_gbps * 1e9)
        self._readers = ThreadPoolExecutor(read_threads, thread_name_prefix="pensieve-disk-r")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="pensieve-disk-w")
        self._writes = WriteBuffers(self.block_bytes, bool(gpu_caches) and
                                    gpu_caches[0].device.type == "cuda")
        """Pooled write buffers; files whose write is queued or running, their bytes lent
        to a prefetch or a restore that needs them."""
        self._reads: dict[str, tuple[DiskEntry, Future[memoryview | None]]] = {}
        self._loaded: dict[str, memoryview] = {}
        self._restored: dict[str, None] = {}
        """Names in ``_loaded`` restored at least once, least recently restored first."""
        """Verified payloads of ready entries, by file name, until restored or dropped."""
        self._spare: list[disk_files.ReadBuffer] = []
        """Read buffers whose payload was restored, read into again (a fresh buffer's pages
        are faulted in as it fills: reads into fresh buffers ran at a third of the rate of
        reads into reused ones on the development VM, docs/performance.md)."""
        self._cpu_blocks = chunk_major_blocks(cpu_caches)
        """``[num_cpu_blocks, L * 2 * C * Hkv * D]`` when the CPU tier is chunk-major (one
        block's KV over all layers is one contiguous region, as on CUDA): a restore is then
        one copy; None: one copy per layer."""
        self._spare_max = max(4 * read_threads, SPARE_BYTES // self.block_bytes)
        self._failed: queue.SimpleQueue[DiskEntry] = queue.SimpleQueue()
        """Entries whose write failed (put by the writer thread)."""
        self.reads_skipped = 0
        self.writes_skipped = 0
        """Chunks dropped instead of written: the writer was WRITE_BACKLOG_BYTES behind."""
        self.write_errors = 0
        self.bytes_written = 0
        self.bytes_read = 0
        self._read_s = 0.0
        """Wall time during which at least one read ran: ``bytes_read`` over it is the rate
        the readers reach together (each read's own time, summed, would give one reader's
        rate: with 16 readers sharing the disk, a sixteenth of what they read together)."""
        self._reading = 0
        self._busy_since = 0.0
        self._read_lock = threading.Lock()
        self.found = self._scan()

    # ------------------------------------------------------------------ start
    def _scan(self) -> int:
        """Register the directory's files of this fingerprint (not ready: each is read and
        checked when its conversation's next turn comes); returns how many."""
        found = foreign = 0
        for name in sorted(os.listdir(self.path)):
            if name.endswith(disk_files.TMP_SUFFIX):  # a write cut off by a crash or a stop
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(self.path, name))
                continue
            if not name.endswith(".kv"):
                continue
            h = disk_files.read_header(os.path.join(self.path, name))
            if h is None or h.fingerprint != self.fingerprint or h.nbytes != self.block_bytes:
                foreign += 1
                continue
            entry = DiskEntry(h.conversation_id, h.index, h.tokens, h.prefix_hash,
                              found_key(h.written_at))
            full = h.tokens == self.index.chunk_size
            if entry.name != name or not 0 < h.tokens <= self.index.chunk_size or \
                    full == bool(h.conversation_id):
                foreign += 1
            elif self.index.add(entry):
                found += 1
                if not full:  # a partial chunk: its conversation's own
                    self.index.hold(h.conversation_id, h.index, entry)
            else:  # beyond the capacity (a smaller --disk-kv-gb than before)
                os.remove(os.path.join(self.path, name))
        if found or foreign:
            log.info("disk tier %s: %d chunk files kept from before, %d of another model, "
                     "layout or version ignored", self.path, found, foreign)
        return found

    # ------------------------------------------------------------------ reads
    def prefetch(self, conversation_id: str, tokens: list[int] | None = None,
                 salt: bytes = b"", dropped: list[int] | None = None,
                 hashes: list[bytes] | None = None,
                 cache: TieredKVCache | None = None) -> None:
        """Start reading the files a turn may restore that are not ready yet and worth
        reading (:attr:`worth`; a slower read than recomputation is not started: the step
        would wait for it and the admission recompute the chunk anyway): the conversation's
        own and, given the turn's ``tokens`` and ``salt``, those of its leading full chunks
        by hash (:meth:`DiskIndex.wanted`; ``dropped``: the conversation's dropped chunks
        when it has KV; ``hashes``: the turn's chunk hashes, ``Request.share_hashes``;
        ``cache``: the cache whose recompute costs decide what is worth reading,
        :func:`~pensieve.core.disk_restore.worth_reading`; None: every file)."""
        self.start_reads(self.index.of(conversation_id) if tokens is None else
                         self.index.wanted(conversation_id, tokens, salt, len(tokens) - 1,
                                           dropped, hashes), conversation_id, cache)

    def start_reads(self, entries: list[DiskEntry], waiter: str | None = None,
                    cache: TieredKVCache | None = None) -> None:
        """Start reading those of ``entries`` not ready nor being read, and worth reading
        (by ``cache``'s costs; None: all); conversation ``waiter``'s turn waits for these
        and for those already being read (``DiskIndex.reading``)."""
        read_s = self.index.read_chunk_s
        for entry in entries:
            if entry.ready:
                continue
            if entry.name not in self._reads:
                if cache is not None and not worth_reading(cache, entry, read_s):
                    self.reads_skipped += 1
                    continue
                self._reads[entry.name] = (entry, self._readers.submit(self._read, entry))
            if waiter is not None:
                self.index.await_read(entry.name, waiter)

    def _read(self, entry: DiskEntry) -> memoryview | None:
        queued = self._writes.lend(entry)  # its buffer is ours now: never pooled again
        if queued is not None:
            return queued
        with self._read_lock:
            if not self._reading:
                self._busy_since = time.perf_counter()
            self._reading += 1
        try:
            spare = self._spare.pop()  # list.pop is atomic: no lock
        except IndexError:
            spare = None
        data = None
        try:
            data = disk_files.read_file(os.path.join(self.path, entry.name), spare)
        except OSError:
            return None
        finally:
            with self._read_lock:
                self._reading -= 1
                if not self._reading:
                    self._read_s += time.perf_counter() - self._busy_since
                if data is not None:
                    self.bytes_read += len(data)
        return disk_files.decode(data, self.fingerprint, entry.conversation_id, entry.index,
                                 entry.tokens, entry.prefix_hash, self.block_bytes)

    def collect(self, wait: bool = True) -> None:
        """Take the reads that are done (``wait``: every read started so far, waiting for
        those still running); mark their entries ready or forget them; forget the entries
        whose write failed. The engine waits only when no request runs: otherwise a turn
        whose reads still run is not admitted (``DiskIndex.reading``) and the running
        requests' step goes on without waiting for them."""
        index = self.index
        for name, (entry, fut) in list(self._reads.items()):
            if not wait and not fut.done():
                continue
            payload = fut.result()
            del self._reads[name]
            index.read_done(name)
            if not index.live(entry):
                continue  # dropped meanwhile
            if payload is not None:
                self._loaded[name] = payload
            index.set_ready(entry, payload is not None)
        self._bound_loaded()
        while not self._failed.empty():
            entry = self._failed.get()
            index.forget(entry)  # no-op if dropped meanwhile
        if self._measure and self._read_s > 0 and self.bytes_read:
            index.read_chunk_s = self.block_bytes * self._read_s / self.bytes_read

    def _bound_loaded(self) -> None:
        """Let go of payloads (their entries are no longer ready) past RESTORED_LOADED_BYTES
        of restored ones, least recently restored first, and past UNHELD_LOADED_BYTES of
        unrestored ones no one holds, oldest first (the payloads of a conversation's own
        dropped chunks wait for its admission)."""
        files = self.index.files
        restored = list(self._restored)
        drop = restored[:max(0, len(restored) - RESTORED_LOADED_BYTES // self.block_bytes)]
        unheld = [n for n in self._loaded if n not in self._restored
                  and (n not in files or not files[n].holders)]
        drop += unheld[:max(0, len(unheld) - UNHELD_LOADED_BYTES // self.block_bytes)]
        for name in drop:
            entry = files.get(name)
            if entry is not None:
                entry.ready = False
            self._restored.pop(name, None)
            self._recycle(self._loaded.pop(name))

    # ------------------------------------------------------------------ a step
    def apply(self, plan: DiskPlan, sync: Callable[[], None] | None = None) -> None:
        """Carry out the step's disk plan (:attr:`SchedulerOutput.disk`, module docstring);
        ``sync`` waits for copies in flight into the CPU tier first (CUDA)."""
        if not plan:
            return
        if sync is not None and (plan.writes or plan.reads):
            sync()
        # bytes out of the spilled blocks first: a restored chunk may reuse one of them
        writes = self._spilled_bytes(plan.writes)
        for entry, block in plan.reads:
            payload = self._loaded.get(entry.name)  # kept: other turns may restore it
            if payload is not None:
                self._restored.pop(entry.name, None)
                self._restored[entry.name] = None
            if payload is None:
                payload = self._writes.lend(entry)
            if payload is None:
                raise RuntimeError(f"disk tier: chunk {entry.name} restored without its bytes")
            self._restore(payload, block)
        if plan.reads:
            self._bound_loaded()
        for name in plan.deletes:  # before the writes: a name may be written anew
            self._restored.pop(name, None)
            dropped = self._loaded.pop(name, None)
            if dropped is not None:
                self._recycle(dropped)
            self._writer.submit(self._delete, name)
        for entry, buf in writes:
            self._submit_write(entry, buf)

    def _restore(self, payload: memoryview, block: int) -> None:
        """Copy a chunk's payload (``[L, 2, C, Hkv, D]``) into CPU block ``block``: one
        contiguous copy on a chunk-major tier, else one per layer (host copies: done when
        this returns)."""
        view = torch.frombuffer(payload, dtype=torch.uint8).view(self.dtype)
        if self._cpu_blocks is not None:
            self._cpu_blocks[block].copy_(view)
            return
        kv = view.view(self.shape)
        for layer, cache in enumerate(self.cpu_caches):
            cache[:, block].copy_(kv[layer])

    def _recycle(self, payload: memoryview) -> None:
        """Keep the buffer a read payload lies in for a later read (not a queued write's
        bytes lent to a read, which are no read buffer: such a buffer is freed when its last
        view goes, neither read into nor written from again)."""
        buf = payload.obj
        if isinstance(buf, disk_files.ReadBuffer) and len(self._spare) < self._spare_max:
            try:
                payload.release()
            except BufferError:  # still exported (a tensor over it): not reused
                return
            self._spare.append(buf)

    def _spilled_bytes(self, spills: list[tuple[bool, int, DiskEntry]]
                       ) -> list[tuple[DiskEntry, torch.Tensor]]:
        """Copies of the spilled blocks' K and V over all layers, ``[L, 2, C, Hkv, D]`` each,
        in pooled write buffers (``[block_bytes]`` uint8), in plan order
        (:func:`~pensieve.engine.disk_writes.copy_out`)."""
        bufs = self._writes.take(len(spills))
        copy_out(spills, bufs, self.cpu_caches, self.gpu_caches, self._cpu_blocks)
        return [(e, buf) for (_, _, e), buf in zip(spills, bufs)]

    def _submit_write(self, entry: DiskEntry, buf: torch.Tensor) -> None:
        write = self._writes.queue(entry, buf, WRITE_BACKLOG_BYTES)
        if write is None:
            self.writes_skipped += 1
            if self.writes_skipped == 1 or self.writes_skipped % 1000 == 0:
                log.warning("disk tier: the writer is %.1f GiB behind; a chunk leaving "
                            "the CPU tier is dropped instead (%d so far)",
                            self._writes.queued_bytes / 2**30, self.writes_skipped)
            self._failed.put(entry)  # forgotten at the next collect, as a failed write
            return
        self._writer.submit(self._write, write)

    def _write(self, write: QueuedWrite) -> None:
        entry, payload = write.entry, write.payload
        header = disk_files.make_header(self.fingerprint, entry.conversation_id, entry.index,
                                        entry.tokens, entry.prefix_hash, payload, time.time())
        try:
            disk_files.write_atomic(os.path.join(self.path, entry.name),
                                    disk_files.encode_head(header), payload)
            self.bytes_written += payload.nbytes
        except OSError as e:
            self.write_errors += 1
            if self.write_errors == 1 or self.write_errors % 1000 == 0:
                log.warning("disk tier: write of %s failed (%s); its chunk is dropped "
                            "(%d failed writes so far)", entry.name, e, self.write_errors)
            self._failed.put(entry)
        finally:
            self._writes.done(write)  # its buffer back in the pool, unless lent

    def wait_writes(self) -> None:
        """Wait until the writes and deletes submitted so far are done."""
        self._writer.submit(lambda: None).result()

    def _delete(self, name: str) -> None:
        if self._writes.writing(name):
            return  # written again since: that write is the file now
        try:
            os.remove(os.path.join(self.path, name))
        except OSError:
            pass

    # ------------------------------------------------------------------ the end
    def close(self, cache: TieredKVCache | None) -> None:
        """Write the idle conversations' chunks that are not on disk yet (GPU and CPU tiers,
        within capacity), then wait for every write (module docstring)."""
        if cache is not None:
            self.apply(cache.take_disk_plan())
            self._flush(cache)
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self._writes.clear()

    def _flush(self, cache: TieredKVCache) -> None:
        """Spill every idle conversation's chunks still in a tier
        (:func:`~pensieve.core.disk_index.spill_idle`)."""
        spill_idle(self.index, cache.conversations.values(), self.index.chunk_size,
                   cache.index.key_now, lambda: self.apply(cache.take_disk_plan()))

    def stats(self) -> dict[str, int]:
        return {"disk_blocks_total": self.index.capacity,
                "disk_blocks_free": self.index.capacity - self.index.size,
                "disk_write_bytes": self.bytes_written, "disk_read_bytes": self.bytes_read,
                "disk_write_errors": self.write_errors,
                "disk_writes_skipped": self.writes_skipped,
                "disk_reads_skipped": self.reads_skipped}


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


def build_disk_tier(cc: CacheConfig, model_name: str, executor: Any, model: Any,
                    model_dtype: torch.dtype) -> DiskTier | None:
    """The disk tier of ``cc`` for the model ``model_name`` over a local executor's tiers (None:
    none asked for). Raises ValueError when the path is not writable or the engine is
    tensor parallel. The read rate is measured on CUDA only: on the CPU the cost model's
    recompute times are a GPU's (as for ``swap_bandwidth_gbps``, whose ``auto`` is off
    there), so without ``disk_read_gbps`` chunks on disk are always read back."""
    if not cc.disk_kv_gb or not cc.disk_kv_path:
        return None
    runner = getattr(executor, "runner", None)
    if runner is None:
        raise ValueError("the disk tier needs a local executor (not tensor parallel)")
    require_cpu_tier(executor.tiers.num_cpu_blocks)
    try:
        disk_files.check_writable(cc.disk_kv_path)
    except ValueError as e:  # a full or read-only disk: serve without the tier
        log.warning("disk tier off: %s", e)
        return None
    kv_dtype = runner.kv_caches[0].dtype
    fp = disk_files.fingerprint(model_name, str(model_dtype), str(kv_dtype),
                                cc.chunk_size, model.num_layers, model.num_kv_heads,
                                model.head_dim, model_digest(model, model_name))
    block_bytes = executor.tiers.block_bytes
    capacity = int(cc.disk_kv_gb * 2**30 // block_bytes)
    tier = DiskTier(cc.disk_kv_path, capacity, cc.chunk_size, fp, runner.swapper.cpu_caches,
                    runner.kv_caches,
                    read_gbps=cc.disk_read_gbps,
                    measure=runner.kv_caches[0].device.type == "cuda")
    log.info("disk tier: %d chunks (%.2f GiB) in %s", capacity,
             capacity * block_bytes / 2**30, cc.disk_kv_path)
    room = shutil.disk_usage(cc.disk_kv_path).free + tier.index.size * block_bytes
    if room < capacity * block_bytes:
        log.warning("disk tier: %s has room for %.2f GiB of the %.2f GiB asked; writes that "
                    "fail once it is full drop their chunks", cc.disk_kv_path, room / 2**30,
                    capacity * block_bytes / 2**30)
    return tier


DIGEST_SLICE = 1 << 24
"""Elements summed at once by :func:`model_digest` (bounds its temporary memory)."""


def model_digest(model: torch.nn.Module, model_path: str) -> str:
    """A digest of the model's weights and config, for the disk tier's fingerprint: the
    ``config.json`` beside the weights (rotary and norm settings change the KV too) and, per
    tensor of the state dict, its name, shape, dtype, the exact integer sum of its elements'
    bits and 64 evenly spaced elements. Weights changed in place under the same path change it
    (any changed element changes the sum unless other changes cancel it exactly); integer sums
    make it the same whatever the device's reduction order. One read of the weights."""
    h = hashlib.blake2b(digest_size=12)
    cfg = os.path.join(model_path, "config.json")
    if os.path.isfile(cfg):
        with open(cfg, "rb") as f:
            h.update(f.read())
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    with torch.no_grad():
        for name, t in sorted(model.state_dict().items()):
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
            flat = t.detach().contiguous().reshape(-1)
            if flat.numel() == 0 or flat.element_size() not in bits:
                continue
            ints = flat.view(bits[flat.element_size()])
            total = sum(int(ints[i:i + DIGEST_SLICE].sum(dtype=torch.int64))
                        for i in range(0, ints.numel(), DIGEST_SLICE))
            # evenly spaced, in integers (a float32 linspace rounds 28,311,551 up to
            # 28,311,552: past the end of SmolLM2's embedding)
            k = min(64, ints.numel())
            at = torch.arange(k, device=ints.device) * (ints.numel() - 1) // max(k - 1, 1)
            h.update(f"{total};".encode() + ints[at].cpu().numpy().tobytes())
    return h.hexdigest()
