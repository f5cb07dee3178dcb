"""The simulator's disk tier: the real core's plans carried out on simulated time, no files.

:class:`SimDiskTier` is :class:`~pensieve.sim.simulator.SimEngine`'s ``disk`` (the
:class:`~pensieve.engine.engine_core.DiskHooks` that :class:`~pensieve.engine.disk_tier.
DiskTier` is on a device). The cache's decisions are the real ones: its
:class:`~pensieve.core.disk_index.DiskIndex` (spills in the retention order, the disk's own
eviction order, hashes) and :func:`~pensieve.core.disk_restore.restore_from_disk` (read back or
recompute). What this module replaces is the I/O, with two
queues of simulated time, one per direction, each one chunk after another at its rate::

    add_request -> prefetch: each file not ready is queued for reading; it is done at
                   max(now, read queue free) + block_bytes / read rate
                   (a chunk whose write is still queued is read from memory: done now)
    step        -> collect:  while requests run, the reads done by now; their entries
                   ready, and a turn whose reads still run is not admitted
                   (``DiskIndex.reading``, as the engine); with none running, the step
                   waits (the clock jumps) until every read started so far is done
                   apply:    the step's writes queued at the write rate (never waited for),
                             restores and deletes counted

Prefetch ``"worth-reading"`` (the engine's, ``DiskTier.prefetch`` with
:func:`~pensieve.core.disk_restore.worth_reading`): a turn reads only the files of chunks that
reading is no slower than recomputing (``read_chunk_s`` at most the chunk's recompute
cost), so a disk too slow to beat recomputation is not
read at all. What-if ``"all"`` (the engine before ``worth_reading``): every file is read.

At admission the core restores every copy that was read (its read time is spent), as on
the engine.

Reads and writes do not slow each other down (two independent queues: the disk's measured
rates, each alone). A read planned into a CPU block costs no step time (on a device it is a
host copy before the step's swap-ins, which the transfer model times). No restart: ``close``
writes nothing at shutdown.

What-if ``wait="always"`` (the engine before it deferred such turns): every step waits for
every read started so far, also those of turns it does not admit.

Pure Python (no torch): the simulator's import stays light.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

from pensieve.core.disk_index import DiskEntry, DiskIndex
from pensieve.core.disk_restore import worth_reading
from pensieve.core.outputs import DiskPlan
from pensieve.core.request import Request
from pensieve.core.tiered_cache import TieredKVCache

SIM_DISK_READ_GBPS = 6.0
"""Default read rate: the H200 host's disk as the engine reads it now (16 readers: 7.94 GB/s
from the page cache; dd 6.1-7.0 GB/s; docs/performance_history.md, "Rerun on the H200 host after the
read-path change"). It was 1.6, the tier's reads before that change."""
SIM_DISK_WRITE_GBPS = 1.2
"""Default write rate: the disk tier's writes on the H200 host (1.21-1.35 GB/s, same
section; 0.85 before the read-path change's rerun)."""
WAIT = ("running", "always")
"""When a step waits for reads still running: only when no request runs (the engine), or
always (the what-if)."""
PREFETCH = ("all", "worth-reading")
"""Which files a turn reads when it is added: every one (the what-if), or those worth reading
(the engine)."""
SIM_DISK_PATH = "(simulated disk: no files)"
"""The ``disk_kv_path`` the simulator gives the config's check when none is given: the
simulator never opens it."""


class _Clock(Protocol):
    def now(self) -> float: ...

    def sleep_until(self, t: float) -> None: ...


class SimDiskTier:
    """A disk of ``capacity_chunks`` chunks of ``block_bytes``, read and written at the given
    rates on ``clock`` (module docstring)."""

    def __init__(self, capacity_chunks: int, chunk_size: int, block_bytes: int, clock: _Clock,
                 read_gbps: float = SIM_DISK_READ_GBPS,
                 write_gbps: float = SIM_DISK_WRITE_GBPS, prefetch: str = "worth-reading",
                 wait: str = "running") -> None:
        """``read_gbps`` also sets the index's ``read_chunk_s``, with which the cache reads a
        chunk back or recomputes it (GB/s: 1e9 bytes a second). ``prefetch``:
        ``"worth-reading"`` (as the engine: by the costs of the cache a prefetch is given;
        every file when given none) or the what-if ``"all"`` (module docstring). ``wait``:
        one of :data:`WAIT` (module docstring)."""
        if wait not in WAIT:
            raise ValueError(f"wait must be one of {', '.join(WAIT)}, got {wait!r}")
        self.wait = wait
        if prefetch not in PREFETCH:
            raise ValueError(f"prefetch must be one of {', '.join(PREFETCH)}, got {prefetch!r}")
        self.prefetch_mode = prefetch
        if block_bytes <= 0:
            raise ValueError("a simulated disk tier needs block_bytes > 0")
        if not (read_gbps > 0 and write_gbps > 0):
            raise ValueError(f"disk rates must be > 0 GB/s, got read {read_gbps}, write "
                             f"{write_gbps}")
        self.index = DiskIndex(capacity_chunks, chunk_size)
        self.clock = clock
        self.block_bytes = block_bytes
        self.read_gbps = read_gbps
        self.write_gbps = write_gbps
        self.read_chunk_s = block_bytes / (read_gbps * 1e9)
        self.write_chunk_s = block_bytes / (write_gbps * 1e9)
        self.index.read_chunk_s = self.read_chunk_s
        self._reads: dict[str, tuple[DiskEntry, float]] = {}
        """Reads started and not collected: file name -> (entry, done at)."""
        self._writing: dict[str, tuple[DiskEntry, float]] = {}
        """Writes queued or running: file name -> (entry, done at)."""
        self._write_order: deque[tuple[float, str, DiskEntry]] = deque()
        self._read_free_at = 0.0
        self._write_free_at = 0.0
        self.bytes_read = 0
        self.bytes_written = 0
        self.reads_from_memory = 0
        """Chunks prefetched while their write was still queued (no disk read)."""
        self.reads_skipped = 0
        """Chunks not read since recomputing them is sooner (``worth-reading``, as the
        engine)."""
        self.restored_chunks = 0
        self.deleted_files = 0
        self.read_wait_s = 0.0
        """Simulated time steps waited for reads when they scheduled."""
        self.read_waits = 0
        """Steps that waited for a read."""
        self.apply_s = (0.0, 0.0, 0.0)  # no host copies: a step's disk plan costs no time
        self.write_backlog_max_s = 0.0
        """Most seconds of writes ever queued ahead (the writer's lag behind the spills)."""

    # ------------------------------------------------------------------ reads
    def prefetch(self, conversation_id: str, tokens: list[int] | None = None,
                 salt: bytes = b"", dropped: list[int] | None = None,
                 hashes: list[bytes] | None = None,
                 cache: TieredKVCache | None = None) -> None:
        """Queue reads of the files the turn may restore that are not ready yet (as
        ``DiskTier.prefetch``; ``cache``: whose costs decide what is worth reading)."""
        now = self.clock.now()
        entries = (self.index.of(conversation_id) if tokens is None else
                   self.index.wanted(conversation_id, tokens, salt, len(tokens) - 1,
                                     dropped, hashes))
        for entry in entries:
            if entry.ready:
                continue
            if entry.name not in self._reads:
                if self.prefetch_mode == "worth-reading" and cache is not None \
                        and not worth_reading(cache, entry, self.read_chunk_s):
                    self.reads_skipped += 1
                    continue
                queued = self._writing.get(entry.name)
                if queued is not None and queued[0] is entry and queued[1] > now:
                    self.reads_from_memory += 1  # its bytes are still in the writer's queue
                    done = now
                else:
                    done = max(now, self._read_free_at) + self.read_chunk_s
                    self._read_free_at = done
                    self.bytes_read += self.block_bytes
                self._reads[entry.name] = (entry, done)
            self.index.pin(entry.name, conversation_id)  # as DiskTier.start_reads

    def collect(self, wait: bool = True) -> None:
        """The reads done by now become ready (their turns may be admitted); with ``wait``
        (no request runs) or the what-if ``wait="always"``, the step first waits until every
        read started so far is done."""
        if not self._reads:
            return
        now = self.clock.now()
        if wait or self.wait == "always":
            until = max(done for _, done in self._reads.values())
            if until > now:
                self.read_wait_s += until - now
                self.read_waits += 1
                self.clock.sleep_until(until)
                now = until
        index = self.index
        for name, (entry, done) in list(self._reads.items()):
            if done > now:
                continue
            del self._reads[name]
            index.unpin(name)
            index.set_ready(entry, True)  # no-op if dropped since

    # ------------------------------------------------------------------ a step
    def apply(self, plan: DiskPlan, sync: Callable[[], None] | None = None) -> None:
        """Queue the step's writes, those ahead of their spills too
        (:attr:`SchedulerOutput.disk`); count its restores and deletes (``sync``: unused, no
        device copies)."""
        if not plan:
            return
        now = self.clock.now()
        order = self._write_order
        while order and order[0][0] <= now:  # writes done: their bytes leave memory
            _, name, entry = order.popleft()
            queued = self._writing.get(name)
            if queued is not None and queued[0] is entry:
                del self._writing[name]
        for entry in [w[2] for w in plan.writes] + [e for _, e in plan.ahead]:
            done = max(now, self._write_free_at) + self.write_chunk_s
            self._write_free_at = done
            self._writing[entry.name] = (entry, done)
            order.append((done, entry.name, entry))
            self.bytes_written += self.block_bytes
        self.write_backlog_max_s = max(self.write_backlog_max_s, self._write_free_at - now)
        self.restored_chunks += len(plan.reads)
        for entry, _ in plan.reads:  # its bytes let go, as the engine's once it has restored
            entry.ready = False  # RESTORED_LOADED_BYTES more (the simulator keeps none)
        self.deleted_files += len(plan.deletes)

    def publish(self, cache: TieredKVCache, finished: Iterable[Request]) -> None:
        """No shared store in the simulator: nothing written through."""

    def close(self, cache: TieredKVCache | None) -> None:
        """The last plan; nothing is written at shutdown (the simulator has no restart)."""
        self.apply(cache.take_disk_plan() if cache is not None else self.index.take_plan())

    def stats(self) -> dict[str, int]:
        """The engine's disk counters (as :meth:`DiskTier.stats`), and the simulated waits."""
        return {"disk_blocks_total": self.index.capacity,
                "disk_blocks_free": self.index.capacity - self.index.size,
                "disk_write_bytes": self.bytes_written, "disk_read_bytes": self.bytes_read,
                "disk_write_errors": 0, "disk_reads_from_memory": self.reads_from_memory,
                "disk_restored_chunks": self.restored_chunks,
                "disk_reads_skipped": self.reads_skipped,
                "disk_read_waits": self.read_waits,
                "disk_read_wait_us": round(self.read_wait_s * 1e6),
                "disk_write_backlog_max_us": round(self.write_backlog_max_s * 1e6)}

    def settings(self) -> dict[str, float | str]:
        """What a benchmark point records of this disk."""
        return {"disk_prefetch": self.prefetch_mode, "disk_wait": self.wait,
                "disk_capacity_chunks": self.index.capacity, "disk_read_gbps": self.read_gbps,
                "disk_write_gbps": self.write_gbps,
                "disk_read_chunk_ms": round(self.read_chunk_s * 1e3, 4)}


__all__ = ["PREFETCH", "WAIT", "SIM_DISK_PATH", "SIM_DISK_READ_GBPS", "SIM_DISK_WRITE_GBPS",
           "SimDiskTier"]
