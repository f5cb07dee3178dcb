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
  into a pooled write buffer (:mod:`pensieve.engine.disk_writes`) before any copy of the
  step touches the block (the step waits for this copy, not for the write), the chunks
  written ahead of their spills (:mod:`pensieve.core.write_ahead`) likewise but beside the
  step's compute (waited for at the next ``collect``), and written by one writer thread
  (writes and deletes in plan order), the buffer going back to the pool once written unless
  its bytes were lent to a read or a restore meanwhile; each restored chunk's verified
  payload is copied into its CPU block (the step's swap-ins then move it to the GPU; the
  payload is kept for other turns, within RESTORED_LOADED_BYTES), and dropped files are
  deleted.

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

Where the files lie is a :class:`~pensieve.engine.kv_backends.KVBackend`: the local
directory (``--disk-kv-path``), and below it, with ``--kv-remote``, a store several servers
share (:class:`~pensieve.engine.remote_tier.RemoteTier`: Redis / Valkey, or a shared
directory). Its copies join the same index (``DiskEntry.remote``): a turn's remote lookup
starts with its local reads (``prefetch``; the turn waits for it as for them) and its
verified values are added, ready, by ``collect``; ``publish`` (after each step) writes the
ended turns' full chunks through to the store. Without a local directory the spills go to
the store.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from pensieve.core.disk_index import (
    DiskEntry,
    DiskIndex,
    found_key,
    shared_name,
    spill_idle,
)
from pensieve.core.disk_restore import worth_reading
from pensieve.core.outputs import DiskPlan
from pensieve.core.request import Request
from pensieve.core.tiered_cache import TieredKVCache
from pensieve.engine import disk_files, disk_writes
from pensieve.engine.disk_writes import (
    AheadCopies,
    QueuedWrite,
    WriteBuffers,
    chunk_major_blocks,
    copy_in,
    copy_out,
    copy_pool,
)
from pensieve.engine.kv_backends import KVBackend, LocalDirBackend
from pensieve.engine.kv_layout import KVLayout
from pensieve.engine.remote_tier import Found, RemoteTier

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

PROBE_WAIT_S = 3.0
"""Seconds a step with nothing else to run waits for a turn's remote lookup before the turn
goes on without it (its chunks recomputed): a store that hangs costs this much, once."""

def is_shared_name(name: str) -> bool:
    """Whether file ``name`` is a full chunk's (named by its hash, anyone's), not a partial
    chunk's (named by conversation and index)."""
    return "-" not in name


SPARE_BYTES = 1 << 30
"""At most this many bytes of read buffers are kept for reuse (and at least 4 per reader)."""


class DiskTier:
    """Chunk files below the CPU tier: a local directory's, and a shared store's
    (:mod:`pensieve.engine.remote_tier`), read into and written from the CPU tier's blocks."""

    def __init__(self, path: str | None, capacity_chunks: int, layout: KVLayout,
                 fingerprint: str, cpu_caches: list[torch.Tensor],
                 gpu_caches: list[torch.Tensor], read_gbps: float | None = None,
                 measure: bool = True, read_threads: int = READ_THREADS,
                 remote: RemoteTier | None = None) -> None:
        """``path``: the local directory (None: none; ``remote`` then takes the spills).
        ``layout``: the engine's KV layout: a file's payload is one chunk of it
        (:attr:`shape`, :attr:`dtype`, :attr:`block_bytes`), its chunk size the index's.
        ``cpu_caches`` / ``gpu_caches``: per layer ``[2, num_blocks, C, Hkv, D]`` (the CPU
        tier and the device cache), checked against ``layout``. ``read_gbps``: the disk's read
        rate for the read-or-recompute choice; None: measured on the reads if ``measure``
        (until the first one, always read), else always read. ``remote``: the shared store
        below (None: none)."""
        if path is None and remote is None:
            raise ValueError("a disk tier needs a local directory or a remote store")
        self.local = LocalDirBackend(path) if path is not None else None
        """The local directory; None: spills go to the remote store."""
        self.remote = remote
        self.path = path
        self.fingerprint = fingerprint
        for caches, what in ((cpu_caches, "CPU tier"), (gpu_caches, "GPU KV caches")):
            if caches:
                layout.check(caches, what)
        self.cpu_caches = cpu_caches
        self.gpu_caches = gpu_caches
        self.shape = layout.chunk_shape
        """A file's payload: one chunk, ``[L, 2, C, Hkv, D]``."""
        self.dtype = layout.dtype
        self.block_bytes = layout.block_bytes
        """Bytes of a file's payload: the layout's bytes per chunk."""
        self.index = DiskIndex(capacity_chunks, layout.chunk_size)
        self._measure = measure and read_gbps is None
        if read_gbps is not None:
            self.index.read_chunk_s = self.block_bytes / (read_gbps * 1e9)
        self._readers = ThreadPoolExecutor(read_threads, thread_name_prefix="pensieve-disk-r")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="pensieve-disk-w")
        self._copies = copy_pool()  # a step's host copies of chunks (disk_writes.each)
        self.apply_s = (0.0, 0.0, 0.0)  # the last apply's seconds: sync, spills out, restores in
        self._writes = WriteBuffers(self.block_bytes, False, min(  # none made on the step
            disk_writes.WRITE_READY_BYTES // self.block_bytes,
            (cpu_caches[0].shape[1] if cpu_caches else 0) // 8))
        """Pooled write buffers; queued writes (their bytes lent to a read that needs them)."""
        self._reads: dict[str, tuple[DiskEntry, Future[memoryview | None]]] = {}
        self._loaded: dict[str, memoryview] = {}
        """Verified payloads of ready entries, by file name, until restored or dropped."""
        self._restored: dict[str, None] = {}  # names of _loaded restored, least recent first
        self._spare: list[disk_files.ReadBuffer] = []
        """Read buffers whose payload was restored, read into again (a fresh buffer's pages
        are faulted in as it fills: reads into fresh buffers ran at a third of the rate of
        reads into reused ones on the development VM, docs/performance.md)."""
        self._cpu_blocks = chunk_major_blocks(cpu_caches)
        """``[num_cpu_blocks, L * 2 * C * Hkv * D]`` when the CPU tier is chunk-major (one
        block's KV over all layers is one region, as on CUDA): one copy a chunk; None: one a
        layer."""
        self._ahead = AheadCopies(self._copies, cpu_caches, self._cpu_blocks)  # written ahead
        self._spare_max = max(4 * read_threads, SPARE_BYTES // self.block_bytes)
        self._failed: queue.SimpleQueue[DiskEntry] = queue.SimpleQueue()
        """Entries whose write failed (put by the writer thread)."""
        self.reads_skipped = 0
        self.writes_skipped = 0
        """Chunks dropped instead of written: the writer was WRITE_BACKLOG_BYTES behind."""
        self.write_errors = 0
        self.bytes_written = self.bytes_read = 0
        self._read_s = 0.0
        """Wall time during which at least one read ran: ``bytes_read`` over it is the rate
        the readers reach together (each read's own time, summed, would give one reader's
        rate: with 16 readers sharing the disk, a sixteenth of what they read together)."""
        self._reading = 0
        self._busy_since = 0.0
        self._wait_since: dict[str, float] = {}  # conversation id -> its turn's wait began
        self.read_wait_s, self.read_waits = 0.0, 0  # queued turns' waits for reads (_waited)
        self._read_lock = threading.Lock()
        self._probes: dict[str, tuple[Future[list[Found]], list[str]]] = {}
        """Remote lookups running, by their key (``DiskIndex.pin``'s name): the
        future and the names it looks up."""
        self._probing: dict[str, str] = {}
        """Name -> the key of the lookup running for it (a turn of the same chunks waits for
        that one instead of reading them again)."""
        self._probe_seq = 0
        self.found = self._scan() if self.local is not None else 0

    # ------------------------------------------------------------------ start
    def _scan(self) -> int:
        """Register the directory's files of this fingerprint (not ready: each is read and
        checked when its conversation's next turn comes); returns how many."""
        assert self.local is not None
        found = foreign = 0
        self.local.clean_temporaries()  # writes cut off by a crash or a stop
        for name in sorted(os.listdir(self.local.path)):
            if not name.endswith(".kv"):
                continue
            h = disk_files.read_header(self.local.file(name))
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
                self.local.delete([name])
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
        if hashes is None and tokens is not None:
            hashes = []  # shared by the local and the remote lookups
        self.start_reads(self.index.of(conversation_id) if tokens is None else
                         self.index.wanted(conversation_id, tokens, salt, len(tokens) - 1,
                                           dropped, hashes), conversation_id, cache)
        if self.remote is not None and tokens is not None and hashes is not None:
            self._probe_remote(conversation_id, tokens, salt, dropped, hashes, cache)

    def _probe_remote(self, conversation_id: str, tokens: list[int], salt: bytes,
                      dropped: list[int] | None, hashes: list[bytes],
                      cache: TieredKVCache | None) -> None:
        """Start looking up in the shared store the turn's full chunks (before its last
        token; the dropped ones of a conversation with KV, else the leading ones) that are
        neither known to the index nor on the GPU by hash; the turn waits for the lookup
        as for a read (``DiskIndex.pin``), and for those another turn's lookup is
        reading already."""
        remote = self.remote
        assert remote is not None
        blocks = cache.blocks if cache is not None else None
        if cache is not None and blocks is not None and hashes:  # looked up by hash below
            blocks.ready_for(hashes[0], cache.conversations.get(conversation_id))
        wanted = remote.wanted(tokens, salt, dropped, hashes, self.index.files,
                               blocks.on_gpu if blocks is not None else ())
        chunks = [w for w in wanted if w[1] not in self._probing]
        waits = {self._probing[w[1]] for w in wanted if w[1] in self._probing}
        if chunks:
            self._probe_seq += 1
            key = f"remote:{self._probe_seq}"
            self._probes[key] = (remote.probe(chunks), [name for _, name, _ in chunks])
            for _, name, _ in chunks:
                self._probing[name] = key
            waits.add(key)
        for key in waits:
            self._pin(key, conversation_id)

    def _collect_probes(self, wait: bool) -> None:
        """Add the verified values of the remote lookups that are done to the index, ready
        (``wait``: every lookup, each for at most PROBE_WAIT_S more; one still running then
        is left to finish unheard, and its turns recompute)."""
        index, c = self.index, self.index.chunk_size
        deadline = time.monotonic() + PROBE_WAIT_S
        for key, (fut, names) in list(self._probes.items()):
            if not fut.done():
                if not wait:
                    continue
                try:
                    fut.result(timeout=max(0.0, deadline - time.monotonic()))
                except FutureTimeout:
                    pass
            found = fut.result() if fut.done() else []
            del self._probes[key]
            for name in names:
                if self._probing.get(name) == key:
                    del self._probing[name]
            for waiter in index.unpin(key):
                self._waited(waiter)
            for f in found:
                name = shared_name(f.prefix_hash)
                if name in index.files:
                    continue  # known meanwhile
                entry = DiskEntry("", f.index, c, f.prefix_hash, found_key(time.time()),
                                  remote=True)
                if not index.add(entry):
                    break
                entry.ready = True
                self._loaded[name] = f.payload

    def start_reads(self, entries: list[DiskEntry], waiter: str | None = None,
                    cache: TieredKVCache | None = None) -> None:
        """Start reading those of ``entries`` not ready nor being read, and worth reading
        (by ``cache``'s costs; None: all); conversation ``waiter``'s turn waits for these
        and for those already being read (``DiskIndex.reading``)."""
        read_s = self.index.read_chunk_s
        self._ahead.wait(self._ahead_copied)  # a file written ahead may be one of them
        for entry in entries:
            if entry.ready:
                continue
            if entry.name not in self._reads:
                if cache is not None and not worth_reading(cache, entry, read_s):
                    self.reads_skipped += 1
                    continue
                self._reads[entry.name] = (entry, self._readers.submit(self._read, entry))
            if waiter is not None:
                self._pin(entry.name, waiter)

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
            data = self._backend(entry).get([entry.name], [spare])[0]
            if data is None:
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
        self._ahead.wait(self._ahead_copied)  # done beside the last step's compute
        if self._probes:
            self._collect_probes(wait)
        for name, (entry, fut) in list(self._reads.items()):
            if not wait and not fut.done():
                continue
            payload = fut.result()
            del self._reads[name]
            for waiter in index.unpin(name):
                self._waited(waiter)
            if not index.live(entry):
                continue  # dropped meanwhile
            if payload is not None:
                self._loaded[name] = payload
            index.set_ready(entry, payload is not None)
        self._bound_loaded()
        while not self._failed.empty():
            entry = self._failed.get()
            index.free(entry)  # no-op if dropped meanwhile
        if self._measure and self._read_s > 0 and self.bytes_read:
            index.read_chunk_s = self.block_bytes * self._read_s / self.bytes_read

    def _pin(self, name: str, conversation_id: str) -> None:
        """The conversation's turn waits for read (or lookup) ``name``; its wait starts."""
        if self.index.pin(name, conversation_id):
            self._wait_since[conversation_id] = time.perf_counter()

    def _waited(self, conversation_id: str) -> None:
        """The conversation's turn waits for no read now: count its wait since :meth:`_pin`."""
        since = self._wait_since.pop(conversation_id, None)
        if since is not None:
            self.read_wait_s += time.perf_counter() - since
            self.read_waits += 1

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
        self.apply_s = (0.0, 0.0, 0.0)
        self._ahead.wait(self._ahead_copied)  # (done at the step's collect, but for close)
        if not plan:
            return
        t0 = time.perf_counter()
        if sync is not None and (plan.writes or plan.reads or plan.ahead):
            sync()
        t1 = time.perf_counter()
        spills = plan.writes
        if self.local is None and self.remote is not None:  # the store holds some already
            known = self.remote.known
            spills = [w for w in spills if not known(w[2].name)]
        # bytes out of the spilled blocks first (a restored chunk may reuse one of them), in
        # pooled write buffers ([block_bytes] uint8, [L, 2, C, Hkv, D]), in plan order
        bufs = self._writes.take(len(spills))
        copy_out(spills, bufs, self.cpu_caches, self.gpu_caches, self._cpu_blocks, self._copies)
        t2 = time.perf_counter()
        restores = []
        for entry, block in plan.reads:
            payload = self._loaded.get(entry.name)  # kept: other turns may restore it
            if payload is not None:
                self._restored.pop(entry.name, None)
                self._restored[entry.name] = None
            if payload is None:
                payload = self._writes.lend(entry)
            if payload is None:
                raise RuntimeError(f"disk tier: chunk {entry.name} restored without its bytes")
            restores.append((payload, block))
            if entry.remote and self.remote is not None:
                self.remote.count_hit(entry.tokens, self.block_bytes)
        copy_in(restores, self.cpu_caches, self._cpu_blocks, self.shape, self.dtype,
                self._copies)
        self.apply_s = (t1 - t0, t2 - t1, time.perf_counter() - t2)
        if plan.reads:
            self._bound_loaded()
        for name in plan.deletes:  # before the writes: a name may be written anew
            self._restored.pop(name, None)
            dropped = self._loaded.pop(name, None)
            if dropped is not None:
                self._recycle(dropped)
            self._writer.submit(self._delete, name)
        for (_, _, entry), buf in zip(spills, bufs):
            self._submit_write(entry, buf)
        if plan.ahead:
            self._start_ahead(plan.ahead)

    def _start_ahead(self, ahead: list[tuple[int, DiskEntry]]) -> None:
        """Copy the chunks written ahead (``DiskPlan.ahead``) into idle write buffers (half
        the ready ones kept for spills) beside the step's compute; those without one (or known
        to the shared store, which takes the spills) are forgotten at the next collect."""
        if self.local is None and self.remote is not None:
            ahead = [a for a in ahead if not self.remote.known(a[1].name)]
        bufs = self._writes.take_idle(len(ahead), keep=self._writes.ready // 2)
        for _, entry in ahead[len(bufs):]:
            self._failed.put(entry)
        self._ahead.start(ahead[:len(bufs)], bufs)

    def _ahead_copied(self, entry: DiskEntry, buf: torch.Tensor) -> None:
        if self.index.live(entry):
            self._submit_write(entry, buf)
        else:
            self._writes.put_back(buf)

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
            err = self._backend(entry).put([(entry.name, disk_files.encode_head(header),
                                             payload)])[0]
            if err is not None:
                raise err
            self.bytes_written += payload.nbytes
            if self.local is None and self.remote is not None:
                self.remote.remember([entry.name])
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
        self._ahead.wait(self._ahead_copied)
        self._writer.submit(lambda: None).result()

    def _delete(self, name: str) -> None:
        if self._writes.writing(name):
            return  # written again since: that write is the file now
        if self.local is not None:
            self.local.delete([name])  # none there for a remote copy's name: a no-op
        elif self.remote is not None and not is_shared_name(name):
            with contextlib.suppress(OSError):  # a partial chunk: this conversation's own
                self.remote.backend.delete([name])

    def _backend(self, entry: DiskEntry) -> KVBackend:
        """Where ``entry``'s copy lies."""
        if self.local is not None and not entry.remote:
            return self.local
        assert self.remote is not None
        return self.remote.backend

    # ------------------------------------------------------------------ the end
    def close(self, cache: TieredKVCache | None) -> None:
        """Write the idle conversations' chunks that are not on disk yet (GPU and CPU tiers,
        within capacity), then wait for every write (module docstring)."""
        if cache is not None:
            self.apply(cache.take_disk_plan())
            self._flush(cache)
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self._copies.shutdown(wait=True)
        self._writes.clear()
        if self.remote is not None:
            self.remote.close()

    def publish(self, cache: TieredKVCache, finished: Iterable[Request]) -> None:
        """Write-through to the shared store (:meth:`RemoteTier.publish`): the full chunks,
        in a GPU or CPU block, of the conversations whose turn just ended, that the store is
        not known to hold. Their bytes are copied out now (the blocks are the turn's, final),
        written by the store's writer thread."""
        remote = self.remote
        if remote is None:
            return
        spills = remote.to_publish(cache.conversations, finished, self.index)
        if spills:
            bufs = remote.buffers.take(len(spills))
            copy_out(spills, bufs, self.cpu_caches, self.gpu_caches, self._cpu_blocks, self._copies)
            remote.publish([e for _, _, e in spills], bufs)

    def _flush(self, cache: TieredKVCache) -> None:
        """Spill every idle conversation's chunks still in a tier
        (:func:`~pensieve.core.disk_index.spill_idle`)."""
        spill_idle(self.index, cache.conversations.values(), self.index.chunk_size,
                   cache.index.key_now, lambda: self.apply(cache.take_disk_plan()))

    def stats(self) -> dict[str, int]:
        remote = self.remote.stats() if self.remote is not None else {}
        return {**remote, "disk_blocks_total": self.index.capacity,
                "disk_blocks_free": self.index.capacity - self.index.size,
                "disk_write_bytes": self.bytes_written, "disk_read_bytes": self.bytes_read,
                "disk_write_errors": self.write_errors,
                "disk_writes_skipped": self.writes_skipped,
                "disk_reads_skipped": self.reads_skipped,
                "disk_read_busy_us": int(self._read_s * 1e6),
                "disk_read_wait_us": int(self.read_wait_s * 1e6),
                "disk_read_waits": self.read_waits,
                "disk_buffers_made_step": self._writes.allocated,
                "disk_buffers_made_ahead": self._writes.made_ahead,
                "disk_spill_copies": self._writes.taken, "disk_ahead_copies": self._ahead.copied}
