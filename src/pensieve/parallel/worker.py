"""The main function of one tensor-parallel rank (a process started by :class:`TPExecutor`).

A rank joins the process group (NCCL on ``cuda:r``, gloo on the CPU), loads the model with the
ordinary loader (same checkpoint, or the same dummy seed), shards it with
:func:`~pensieve.parallel.tp.shard_model`, allocates its slice of the GPU tier and its own CPU
tier (:class:`~pensieve.runner.swapper.KVSwapper`) with the block counts the driver sends, and
then runs the unchanged :class:`~pensieve.runner.model_runner.ModelRunner` on every plan it
receives. Its KV layout (:class:`~pensieve.engine.kv_layout.KVLayout`) comes from the driver
and is checked against the shard; sizing is :func:`pensieve.engine.tiers.tier_sizes`, as for
every executor; measuring the device, allocation and capture are the local executor's own
functions (:mod:`pensieve.engine.local`). All ranks run the same plans in the same order, so
their collectives pair up.

Protocol, over one ``multiprocessing`` pipe per rank (driver <-> rank; pickled tuples):

====================================  =========================================================
driver -> rank                        rank -> driver
====================================  =========================================================
(process start: :class:`WorkerSpec`)  ``("ready", TierSizes)``: ``tier_sizes`` on this rank
``("alloc", num_gpu, num_cpu)``       ``("ok", None)``
``("step", SchedulerOutput)``         rank 0 only: ``("out", RunnerOutput, bytes_in, bytes_out)``
``("stop",)``                         (the rank leaves the group and exits)
====================================  =========================================================

Any exception is sent as ``("error", traceback)`` before the process exits with status 1; a
closed pipe (the driver is gone) ends the rank quietly.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pensieve.engine.kv_layout import KVLayout


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs, fixed at spawn (picklable)."""

    config: Any
    """The engine's :class:`~pensieve.config.EngineConfig`."""
    model_source: Any
    """Checkpoint directory, or the HF config for dummy weights."""
    layout: KVLayout
    """This rank's :class:`~pensieve.engine.kv_layout.KVLayout` (the driver resolved it)."""
    dtype: torch.dtype
    load_format: str
    devices: tuple[str, ...]
    """Device of each rank (``cuda:i`` or ``cpu``)."""
    backend: str
    """``nccl`` or ``gloo``."""
    init_method: str
    """torch.distributed rendezvous (a ``file://`` store private to this executor)."""
    timeout_s: float
    """Collective timeout of the process group."""
    num_threads: int
    """Intra-op CPU threads per rank (CPU ranks share the host's cores)."""


def worker_main(rank: int, spec: WorkerSpec, conn: Connection, load_lock: Any) -> None:
    """Entry point of rank ``rank``; returns when told to stop or when the driver is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    import torch.distributed as dist

    try:
        _serve(rank, spec, conn, load_lock)
    except EOFError:  # the driver closed the pipe (exited): nothing to report to
        pass
    except BaseException:
        try:
            conn.send(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        except Exception:  # the driver is gone
            pass
        sys.exit(1)
    finally:
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _serve(rank: int, spec: WorkerSpec, conn: Connection, load_lock: Any) -> None:
    import torch.distributed as dist

    from pensieve.engine.local import device_memory, start_runner
    from pensieve.engine.tiers import tier_sizes
    from pensieve.models.loader import load_model
    from pensieve.parallel.tp import shard_model

    cfg = spec.config
    world = cfg.model.tensor_parallel_size
    device = torch.device(spec.devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(spec.num_threads)
    if spec.backend == "gloo" and sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all ranks are on this host
    dist.init_process_group(spec.backend, init_method=spec.init_method, rank=rank,
                            world_size=world, timeout=timedelta(seconds=spec.timeout_s))
    torch.manual_seed(cfg.model.seed)
    # A checkpoint bound for a GPU is read into host memory, sharded, then moved: one full copy
    # at a time (the lock) in RAM, only the shard on the device. Dummy weights are drawn on the
    # device itself, as with tensor_parallel_size=1 (same seed, same values).
    staging = device if spec.load_format == "dummy" else torch.device("cpu")
    model: Any
    with load_lock:
        model, hf_config = load_model(spec.model_source, dtype=spec.dtype, device=staging,
                                      load_format=spec.load_format, seed=cfg.model.seed)
        shard_model(model, rank, world)
        if staging != device:
            model.to(device)
        elif device.type == "cuda":
            # the full model was drawn here: give the dropped shards' memory back before the
            # KV tier is sized from the free memory
            import gc

            gc.collect()
            torch.cuda.empty_cache()
    layout = spec.layout
    shard = (model.num_layers, model.num_kv_heads, model.head_dim)
    if shard != (layout.num_layers, layout.num_kv_heads, layout.head_dim):
        raise RuntimeError(f"rank {rank}: the shard has (layers, KV heads, head_dim) {shard}, "
                           f"the driver's KV layout {layout}")
    conn.send(("ready", tier_sizes(cfg, layout.block_bytes, device.type,
                                   device_memory(cfg, device, hf_config, spec.dtype, layout),
                                   ranks=world)))
    _, num_gpu_blocks, num_cpu_blocks = conn.recv()
    # every rank captures the same CUDA graphs: the all-reduces are in them
    runner = start_runner(cfg, model, layout, device, num_gpu_blocks, num_cpu_blocks)
    conn.send(("ok", None))
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        out = runner.execute(msg[1])
        if rank == 0:
            conn.send(("out", out, runner.swapper.bytes_in, runner.swapper.bytes_out))
