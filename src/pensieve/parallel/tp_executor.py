"""The driver's side of tensor parallelism: the :class:`~pensieve.engine.executor.Executor`
of ``LLMEngine`` when ``tensor_parallel_size > 1``.

The engine process stays a pure scheduler: it holds no weights and no KV (only a meta-device
model for shapes) and spawns ``tensor_parallel_size`` rank processes (``spawn`` context, see
:mod:`pensieve.parallel.worker`). Each step, :meth:`TPExecutor.execute` pickles the
``SchedulerOutput`` once and sends it down every rank's pipe; every rank executes it with its
own ``ModelRunner`` (collectives between ranks go over torch.distributed), and rank 0 sends the
``RunnerOutput`` back. The driver waits on rank 0's pipe *and* on every rank's pipe and process
sentinel, so a rank that raises or dies makes the call raise ``RuntimeError`` (after the other
ranks are stopped) instead of hanging; a rank that neither answers nor dies hits the step
timeout (:data:`STEP_TIMEOUT_S`; start-up: :data:`START_TIMEOUT_S`).

Tier sizes: every rank holds the same number of GPU-tier and CPU-tier blocks, each block its
local KV heads, so the scheduler's block ids mean the same on every rank. ``num_gpu_blocks`` /
``num_cpu_blocks`` are per rank; ``gpu_kv_gb`` / ``gpu_memory_utilization`` apply to each
rank's device (each rank reports how many blocks fit after loading its shard; all use the
minimum); ``cpu_kv_gb`` is the host total, shared by the ranks' CPU tiers.

Workers are stopped by :meth:`TPExecutor.shutdown` (``LLM.shutdown()`` /
``LLMEngine.shutdown()``), when the executor is garbage-collected, or at interpreter exit; they
are daemonic, and a rank whose driver vanished sees its pipe close and exits.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import tempfile
import time
import weakref
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from pensieve.config import EngineConfig
from pensieve.core.outputs import RunnerOutput, SchedulerOutput
from pensieve.engine.executor import TierSizes
from pensieve.engine.kv_layout import KVLayout
from pensieve.models.loader import build_model
from pensieve.parallel.tp import check_shardable
from pensieve.parallel.worker import WorkerSpec, worker_main

log = logging.getLogger("pensieve")


STEP_TIMEOUT_S = 600.0
"""The longest a step may take on the ranks before the driver gives up on them."""
START_TIMEOUT_S = 1800.0
"""The longest the ranks may take to start (load their shards, capture their graphs)."""


def rank_devices(device: torch.device, world: int) -> tuple[tuple[str, ...], str]:
    """Device of each rank and the collective backend; ValueError if the host lacks them."""
    if device.type == "cpu":
        return ("cpu",) * world, "gloo"
    if device.type == "cuda":
        base = device.index or 0
        have = torch.cuda.device_count()
        if base + world > have:
            raise ValueError(f"tensor_parallel_size {world} from cuda:{base} needs "
                             f"{base + world} CUDA devices, this host has {have}")
        return tuple(f"cuda:{base + r}" for r in range(world)), "nccl"
    raise ValueError(f"tensor parallelism runs on cuda (NCCL) or cpu (gloo), not {device}")


class TPExecutor:
    """Runs each ``SchedulerOutput`` on ``tensor_parallel_size`` rank processes."""

    def __init__(self, config: EngineConfig, model_source: Any, hf_config: Any,
                 dtype: torch.dtype, load_format: str, device: torch.device) -> None:
        world = config.model.tensor_parallel_size
        self.world = world
        self.model: Any = build_model(hf_config, dtype, "meta")
        """The full (unsharded) model on the meta device: shapes for the engine and the cost
        model, no weights."""
        check_shardable(self.model, world)
        devices, backend = rank_devices(device, world)
        cc = config.cache
        layout = KVLayout.of(self.model, cc, dtype, world)  # one rank's: resolved once, here
        self.step_timeout_s = STEP_TIMEOUT_S
        start_timeout_s = START_TIMEOUT_S

        tmpdir = tempfile.mkdtemp(prefix="pensieve-tp-")
        spec = WorkerSpec(
            config=config, model_source=model_source, dtype=dtype, load_format=load_format,
            layout=layout, devices=devices, backend=backend,
            init_method=f"file://{tmpdir}/rendezvous",
            timeout_s=max(self.step_timeout_s, start_timeout_s),
            num_threads=max(1, (os.cpu_count() or 1) // world),
        )
        ctx = torch.multiprocessing.get_context("spawn")
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop_workers, self._procs, self._conns, tmpdir)
        load_lock = ctx.Lock()
        try:
            for rank in range(world):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=worker_main, args=(rank, spec, child, load_lock),
                                   name=f"pensieve-tp-rank{rank}", daemon=True)
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
            # each rank's tier_sizes over its own device: gpu_kv_gb and gpu_memory_utilization
            # apply to each rank's device (all take the fewest blocks), cpu_kv_gb is the host's
            # total (the same count on every rank)
            fits: list[TierSizes] = [msg[1] for msg in self._recv(range(world), start_timeout_s)]
            num_gpu_blocks = min(t.num_gpu_blocks for t in fits)
            num_cpu_blocks = fits[0].num_cpu_blocks
            for conn in self._conns:
                conn.send(("alloc", num_gpu_blocks, num_cpu_blocks))
            self._recv(range(world), start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        block_bytes = layout.block_bytes
        self._tiers = TierSizes(num_gpu_blocks, num_cpu_blocks, block_bytes)
        self._bytes_in = self._bytes_out = 0
        log.info("tensor parallel x%d (%s, %s): per rank %d KV heads, %d GPU-tier blocks "
                 "(%.2f GiB), %d CPU-tier blocks (%.2f GiB), chunk %d", world, backend,
                 ", ".join(devices), layout.num_kv_heads, num_gpu_blocks,
                 num_gpu_blocks * block_bytes / 2**30, num_cpu_blocks,
                 num_cpu_blocks * block_bytes / 2**30, cc.chunk_size)

    @property
    def tiers(self) -> TierSizes:
        """Blocks per rank (the same on every rank) and one rank's bytes per block."""
        return self._tiers

    def stats(self) -> dict[str, int]:
        """Bytes all ranks together copied between the tiers."""
        return {"swap_in_bytes": self._bytes_in, "swap_out_bytes": self._bytes_out}

    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks (rank order)."""
        return [p.pid for p in self._procs]

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run one step on every rank; rank 0's sampled tokens. Raises RuntimeError if a rank
        failed (the executor is then shut down)."""
        if self._closed:
            raise RuntimeError("tensor-parallel workers are shut down")
        t0 = time.perf_counter()
        payload = pickle.dumps(("step", sched), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(payload)
            except OSError:  # broken pipe: the rank is gone
                self._fail(f"rank {rank} is gone ({self._describe(rank)})")
        (_, out, bytes_in, bytes_out), = self._recv([0], self.step_timeout_s)
        self._bytes_in = bytes_in * self.world  # every rank moves the same bytes
        self._bytes_out = bytes_out * self.world
        return replace(out, step_time_s=time.perf_counter() - t0)

    def shutdown(self) -> None:
        """Stop every rank (politely, then by force); idempotent."""
        self._closed = True
        self._finalizer()

    # ------------------------------------------------------------------ internals

    def _describe(self, rank: int) -> str:
        code = self._procs[rank].exitcode
        return "still running" if code is None else f"exit code {code}"

    def _fail(self, why: str) -> None:
        for p in self._procs:  # the others may be stuck in a collective: no polite stop
            if p.is_alive():
                p.terminate()
        self.shutdown()
        raise RuntimeError(f"tensor parallelism: {why}")

    def _recv(self, ranks: Any, timeout_s: float) -> list[Any]:
        """One message from each rank in ``ranks``; fails on an error report from any rank,
        on any rank's death, or after ``timeout_s``."""
        want = list(ranks)
        got: dict[int, Any] = {}
        rank_of = {id(c): r for r, c in enumerate(self._conns)}
        by_id = {id(c): c for c in self._conns}
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(want):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in want if r not in got]
                self._fail(f"no answer from rank(s) {missing} within {timeout_s:.0f} s")
            ready = wait([*self._conns, *sentinels], timeout=left)
            conns = [by_id[id(c)] for c in ready if id(c) in by_id]
            for conn in conns:  # messages first: an error report beats the bare exit code
                rank = rank_of[id(conn)]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self._procs[rank].join(timeout=1)
                    self._fail(f"rank {rank} exited ({self._describe(rank)})")
                if msg[0] == "error":
                    self._fail(f"a worker failed:\n{msg[1]}")
                if rank not in want or rank in got:
                    self._fail(f"unexpected message {msg[0]!r} from rank {rank}")
                got[rank] = msg
            for s in ready:
                if s in sentinels and len(got) < len(want):
                    rank = sentinels[s]
                    self._procs[rank].join(timeout=1)
                    self._fail(f"rank {rank} died ({self._describe(rank)})")
        return [got[r] for r in want]


def _stop_workers(procs: list[Any], conns: list[Connection], tmpdir: str) -> None:
    """Ask every rank to stop, wait a little, then terminate / kill what is left."""
    stop = pickle.dumps(("stop",))
    for conn in conns:
        try:
            conn.send_bytes(stop)
        except Exception:
            pass
    deadline = time.monotonic() + 10
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    for conn in conns:
        conn.close()
    shutil.rmtree(tmpdir, ignore_errors=True)
