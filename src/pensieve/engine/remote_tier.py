"""The shared KV tier: chunk files on a store several servers share, below the local tiers.

``--kv-remote redis://host:port/db`` (:class:`~pensieve.engine.kv_redis.RedisBackend`) or
``--kv-remote file:///path`` (:class:`~pensieve.engine.kv_backends.SharedDirBackend`)::

    GPU -> CPU -> (local disk, --disk-kv-path) -> remote (--kv-remote)

Values are the disk tier's chunk files (:mod:`pensieve.engine.disk_files`): the same
fingerprint (model digest of weights and config, dtype, KV dtype, chunk size, shapes),
header and crc32, under the same names (a full chunk's salted chained hash, so equal tokens
at equal positions under one tenant and ``cache_salt`` are one value, whichever server
computed them). This class moves them on threads of its own; the disk tier
(:class:`~pensieve.engine.disk_tier.DiskTier`) decides with its index, whose entries a
remote copy joins (``DiskEntry.remote``) once found, read and verified:

- **write-through** (:meth:`publish`): when a turn ends, its conversation's full chunks that
  the store is not known to hold are copied out of their blocks (the step's thread, a host
  copy) and written by one writer thread, in batches; so another server can take the
  conversation over at any time, and a prefix many conversations share is computed once for
  the whole deployment;
- **lookup** (:meth:`probe`): when a turn is added, a reader thread asks the store which of
  its leading full chunks it holds (one batched ``contains``), reads those (batched ``get``)
  and verifies each (:func:`disk_files.decode`); the disk tier adds the verified ones to its
  index, ready, and admission restores them as it restores local files.

Failures never reach a request: a miss, a value that fails its check (corrupt, truncated,
another model's), a timeout or a dead store are a chunk recomputed. After a store error the
tier leaves the store alone for :data:`DOWN_BACKOFF_S` (no lookups, writes dropped), then
tries again. A store that cannot be reached at start is a logged warning
(:func:`open_remote`): the server runs without it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Container, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from pensieve.core.conversation import Conversation, Tier
from pensieve.core.disk_index import DiskEntry, DiskIndex, found_key, shared_name
from pensieve.core.prefix_share import extend_hashes
from pensieve.core.request import Request
from pensieve.engine import disk_files
from pensieve.engine.disk_writes import QueuedWrite, WriteBuffers
from pensieve.engine.kv_backends import KVBackend, SharedDirBackend

log = logging.getLogger("pensieve")

DOWN_BACKOFF_S = 5.0
"""Seconds the tier leaves a store alone after an error (then the next call tries again)."""

WRITE_BACKLOG_BYTES = 1 << 30
"""At most this many bytes of published chunks wait for the writer; past it a chunk is not
published (a store slower than the turns must not grow memory)."""

WRITE_BATCH = 32
"""Values written in one call (one Redis pipeline)."""

READ_BATCH = 32
"""Values read in one call (one ``MGET``)."""

PUBLISHED_NAMES = 1 << 18
"""Names this server wrote or found in the store, remembered so as not to write them again
(most recent first kept)."""


@dataclass
class Found:
    """A value a probe read and verified."""

    index: int
    prefix_hash: str
    payload: memoryview


def open_remote(url: str, fingerprint: str) -> KVBackend | None:
    """The backend of ``--kv-remote url`` (None, with a logged warning: it cannot be reached
    or used now; the server runs without it). ValueError: a URL of no known scheme."""
    try:
        if url.startswith("file://"):
            path = url[len("file://"):]
            if not path.startswith("/"):
                raise ValueError(f"--kv-remote {url!r}: a file URL takes an absolute path "
                                 "(file:///dir)")
            backend = SharedDirBackend(path, fingerprint)
            if not backend.writable:
                log.warning("remote KV tier %s is not writable: it is read only", url)
            return backend
        if url.startswith(("redis://", "rediss://", "unix://", "valkey://")):
            from pensieve.engine.kv_redis import RedisBackend

            return RedisBackend(url.replace("valkey://", "redis://", 1), fingerprint)
    except (OSError, ValueError, ImportError) as e:
        if isinstance(e, ValueError) and "file URL" in str(e):
            raise
        log.warning("remote KV tier %s unavailable (%s): serving without it", url, e)
        return None
    raise ValueError(f"--kv-remote {url!r}: expected redis://host:port/db or file:///path")


class RemoteTier:
    """Lookups and write-through of one shared store (module docstring). Thread-safe where
    it says so; :meth:`probe` and :meth:`publish` are called from the engine's thread."""

    def __init__(self, backend: KVBackend, fingerprint: str, chunk_size: int,
                 block_bytes: int, pin: bool) -> None:
        self.backend = backend
        self.fingerprint = fingerprint
        self.chunk_size = chunk_size
        self.block_bytes = block_bytes
        self.buffers = WriteBuffers(block_bytes, pin)
        self._readers = ThreadPoolExecutor(2, thread_name_prefix="pensieve-remote-r")
        self._queue: queue.SimpleQueue[QueuedWrite | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="pensieve-remote-w",
                                        daemon=True)
        self._writer.start()
        self._lock = threading.Lock()
        self._known: OrderedDict[str, None] = OrderedDict()
        """Names the store held when last seen (written by us, or found)."""
        self._down_until = 0.0
        self.read_bytes = self.write_bytes = 0
        self.reads = self.writes = 0
        """Values read (verified or not) and written."""
        self.read_errors = self.write_errors = 0
        """Values that failed their check, or calls the store failed."""
        self.writes_skipped = 0
        self.hit_tokens = self.hit_bytes = 0
        """Tokens and bytes of remote copies restored into the CPU tier (the disk tier
        counts them at the restore)."""

    # ------------------------------------------------------------------ health
    @property
    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, e: BaseException | str) -> None:
        with self._lock:
            self.write_errors += what == "write"
            self.read_errors += what == "read"
            first = self._down_until == 0.0 or time.monotonic() >= self._down_until
            self._down_until = time.monotonic() + DOWN_BACKOFF_S
        if first:
            log.warning("remote KV tier %s: %s failed (%s); chunks are recomputed, the store "
                        "is tried again in %.0f s", self.backend.url, what, e, DOWN_BACKOFF_S)

    def known(self, name: str) -> bool:
        with self._lock:
            return name in self._known

    def remember(self, names: list[str]) -> None:
        """The store holds these names now."""
        with self._lock:
            for n in names:
                self._known[n] = None
                self._known.move_to_end(n)
            while len(self._known) > PUBLISHED_NAMES:
                self._known.popitem(last=False)

    # ------------------------------------------------------------------ lookups
    def wanted(self, tokens: list[int], salt: bytes, dropped: list[int] | None,
               hashes: list[bytes], files: Mapping[str, DiskEntry],
               on_gpu: Container[bytes]) -> list[tuple[int, str, str]]:
        """(index, name, prefix hash) of the turn's full chunks (before its last token) to
        look up: the ``dropped`` ones of a conversation with KV (None: it has none, its
        leading ones), less those the index knows (``files``: read by the local lookup) and
        those on the GPU by hash (``on_gpu``); ``hashes``: the turn's chunk hashes under
        ``salt`` so far, extended here. None while the store is down."""
        if not self.up:
            return []
        c = self.chunk_size
        n = (len(tokens) - 1) // c
        want = range(n) if dropped is None else [i for i in dropped if i < n]
        if not want:
            return []
        last = max(want) + 1
        if len(hashes) < last:
            extend_hashes(hashes, salt, tokens[len(hashes) * c:last * c], c)
        out = []
        for i in want:
            h = hashes[i]
            name = shared_name(h.hex())
            if name not in files and h not in on_gpu:
                out.append((i, name, h.hex()))
        return out

    def probe(self, chunks: list[tuple[int, str, str]]) -> Future[list[Found]]:
        """Start looking up ``chunks``, (index, name, prefix hash) of a turn's leading full
        chunks in order: the future gives the verified values of the leading run the store
        holds (a chunk it lacks ends the run: admission restores leading runs only)."""
        return self._readers.submit(self._probe, chunks)

    def _probe(self, chunks: list[tuple[int, str, str]]) -> list[Found]:
        if not chunks or not self.up:
            return []
        try:
            have = self.backend.contains([name for _, name, _ in chunks])
        except OSError as e:
            self._failed("read", e)
            return []
        run = next((k for k, h in enumerate(have) if not h), len(chunks))
        found: list[Found] = []
        for at in range(0, run, READ_BATCH):
            batch = chunks[at:min(run, at + READ_BATCH)]
            values = self.backend.get([name for _, name, _ in batch])
            for (i, _, h), value in zip(batch, values):
                payload = None if value is None else disk_files.decode(
                    value, self.fingerprint, "", i, self.chunk_size, h, self.block_bytes)
                with self._lock:
                    self.reads += value is not None
                    self.read_bytes += 0 if value is None else len(value)
                    self.read_errors += value is not None and payload is None
                if payload is None:
                    break  # missing now (evicted, or the store died) or bad: the run ends
                found.append(Found(i, h, payload))
            if len(found) < min(run, at + READ_BATCH):
                break
        self.remember([n for (_, n, _), _ in zip(chunks, found)])
        return found

    def count_hit(self, tokens: int, nbytes: int) -> None:
        """A remote copy of ``tokens`` tokens was restored into the CPU tier."""
        with self._lock:
            self.hit_tokens += tokens
            self.hit_bytes += nbytes

    # ------------------------------------------------------------------ write-through
    def to_publish(self, conversations: Mapping[str, Conversation], finished: Iterable[Request],
                   index: DiskIndex) -> list[tuple[bool, int, DiskEntry]]:
        """(from_gpu, block, entry) of the full chunks, in a GPU or CPU block, of the idle
        conversations whose turn just ended (``finished``) that the store is not known to
        hold (nor the index as a remote copy); none while the store is down or read only.
        Hashes under each conversation's salt (``index.salts``, set at its admission)."""
        if not self.up or not getattr(self.backend, "writable", True):
            return []
        c = self.chunk_size
        spills: list[tuple[bool, int, DiskEntry]] = []
        seen: set[str] = set()
        for req in finished:
            cid = req.conversation_id
            conv = conversations.get(cid) if cid is not None else None
            salt = index.salts.get(cid) if cid is not None else None
            if conv is None or salt is None or conv.running or conv.ephemeral:
                continue
            history = conv.token_ids
            n = min(conv.kv_end, len(history), len(conv.chunks) * c) // c
            hashes = index.hashes_of(conv.conversation_id, history, salt)
            for i in range(min(n, len(hashes))):
                ch = conv.chunks[i]
                if ch.tier is not Tier.GPU and ch.tier is not Tier.CPU:
                    continue
                h = hashes[i].hex()
                name = shared_name(h)
                have = index.files.get(name)
                if name in seen or self.known(name) or (have is not None and have.remote):
                    continue
                seen.add(name)
                spills.append((ch.tier is Tier.GPU, ch.block,
                               DiskEntry("", i, c, h, found_key(0.0), remote=True)))
        return spills

    def publish(self, entries: list[DiskEntry], bufs: list[torch.Tensor]) -> None:
        """Queue the writes of ``entries``, their bytes in ``bufs`` (taken from
        :attr:`buffers`, filled): the writer thread writes them in batches."""
        for entry, buf in zip(entries, bufs):
            write = self.buffers.queue(entry, buf, WRITE_BACKLOG_BYTES)
            if write is None:
                self.writes_skipped += 1
                continue
            self.remember([entry.name])  # not written twice while queued
            self._queue.put(write)

    def _write_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            stop = False
            while len(batch) < WRITE_BATCH:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
            self._write(batch)
            if stop:
                return

    def _write(self, batch: list[QueuedWrite]) -> None:
        try:
            if not self.up:
                with self._lock:
                    self.writes_skipped += len(batch)
                self._forget([w.entry.name for w in batch])
                return
            values = []
            for w in batch:
                e = w.entry
                head = disk_files.encode_head(disk_files.make_header(
                    self.fingerprint, e.conversation_id, e.index, e.tokens, e.prefix_hash,
                    w.payload, time.time()))
                values.append((e.name, head, w.payload))
            errors = self.backend.put(values)
            bad = [w.entry.name for w, err in zip(batch, errors) if err is not None]
            with self._lock:
                self.writes += len(batch) - len(bad)
                self.write_bytes += (len(batch) - len(bad)) * self.block_bytes
            if bad:
                self._forget(bad)
                self._failed("write", next(e for e in errors if e is not None))
        finally:
            for w in batch:
                self.buffers.done(w)

    def _forget(self, names: list[str]) -> None:
        with self._lock:
            for n in names:
                self._known.pop(n, None)

    def wait_writes(self, timeout_s: float = 30.0) -> None:
        """Until the writes queued so far are done (or ``timeout_s`` passed)."""
        deadline = time.monotonic() + timeout_s
        while self.buffers.queued_bytes and time.monotonic() < deadline:
            time.sleep(0.01)

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        """Finish the queued writes, stop the threads, close the connection."""
        self._queue.put(None)
        self._writer.join(timeout=60)
        self._readers.shutdown(wait=True)
        self.buffers.clear()
        self.backend.close()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"remote_read_bytes": self.read_bytes, "remote_write_bytes": self.write_bytes,
                    "remote_reads": self.reads, "remote_writes": self.writes,
                    "remote_read_errors": self.read_errors,
                    "remote_write_errors": self.write_errors,
                    "remote_writes_skipped": self.writes_skipped,
                    "remote_hit_tokens": self.hit_tokens, "remote_hit_bytes": self.hit_bytes,
                    "remote_up": int(self.up)}
