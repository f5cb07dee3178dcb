"""Thread settings of ``pensieve serve``'s processes, so that a busy machine does not make them
spin.

* OpenMP's waiting policy: torch's CPU kernels run on OpenMP threads, and by default a thread
  that finishes its share of a parallel region spins on the CPU waiting for the next one. With
  another process on the same cores the spinning threads take the cores from the threads that
  have work: on a busy 2-core host a decode step of the default model took 188-204 ms per
  token by default and 51-60 ms with ``OMP_WAIT_POLICY=PASSIVE`` (issue 60;
  docs/performance.md, "Threads on a shared host"). :func:`set_thread_env` sets PASSIVE
  (waiting threads sleep) before torch loads, unless the variable is set already.
* Threads per process: the engine process runs the model on every CPU it may use (or
  ``OMP_NUM_THREADS`` when set); the server process, whose torch work is a few small tensors
  per request, on one.
* Cores: on a CPU run with 4 or more CPUs, the server process is pinned to one of them and the
  engine process to the others, so the HTTP side does not preempt the model's threads (vLLM's
  CPU backend reserves cores for its front end the same way). With fewer CPUs both may use all
  of them: one core less for the model would cost more than the server's little work.

:func:`settle_engine_threads` runs in the engine process once its device is known;
:func:`settle_server_threads` in the server process when the engine runs elsewhere.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import Any

log = logging.getLogger("pensieve.threads")

THREAD_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
"""Environment variables set for ``pensieve``'s processes unless already set (read by the
OpenMP runtime when torch loads, and inherited by the engine process)."""

MIN_CPUS_TO_RESERVE = 4
"""A CPU run reserves one CPU for the server process from this many usable CPUs on."""


def set_thread_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set :data:`THREAD_ENV` in ``environ`` (default: this process's environment) where not
    set; returns the values now in effect there. Call before torch is imported: the OpenMP
    runtime reads them once, when it loads."""
    env = os.environ if environ is None else environ
    for key, value in THREAD_ENV.items():
        env.setdefault(key, value)
    return {key: env[key] for key in THREAD_ENV}


def usable_cpus() -> list[int]:
    """The CPUs this process may run on, in order."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def split_cpus(cpus: list[int]) -> tuple[list[int], list[int]]:
    """``(server CPUs, engine CPUs)`` of a CPU run: the first CPU for the server and the rest
    for the engine from :data:`MIN_CPUS_TO_RESERVE` CPUs on, else all of them for both."""
    if len(cpus) >= MIN_CPUS_TO_RESERVE:
        return cpus[:1], cpus[1:]
    return list(cpus), list(cpus)


def _pin(cpus: list[int]) -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


def settle_engine_threads(device_type: str) -> dict[str, Any]:
    """In the engine process: on the CPU, pin it to the engine's CPUs (:func:`split_cpus`) and
    run torch on that many threads (``OMP_NUM_THREADS`` when set wins). Returns
    :func:`thread_settings`."""
    import torch

    if device_type == "cpu":
        _, engine_cpus = split_cpus(usable_cpus())
        _pin(engine_cpus)
        if not os.environ.get("OMP_NUM_THREADS"):
            torch.set_num_threads(len(engine_cpus))
    settings = thread_settings()
    log.info("engine threads: %s", settings)
    return settings


def settle_server_threads(device_type: str) -> None:
    """In the server process, with the engine in a process of its own: one torch thread, and
    on a CPU run the server's CPU (:func:`split_cpus`)."""
    import torch

    torch.set_num_threads(1)
    if device_type == "cpu":
        _pin(split_cpus(usable_cpus())[0])


def thread_settings(_engine: Any = None) -> dict[str, Any]:
    """What is in effect in this process: torch's thread count, the usable CPUs and the
    variables of :data:`THREAD_ENV` and ``OMP_NUM_THREADS``. (Takes and ignores an engine, so
    that the server can ask the engine process for it with ``call``.)"""
    import torch

    return {"torch_threads": torch.get_num_threads(), "cpus": usable_cpus(),
            **{k: os.environ.get(k) for k in (*THREAD_ENV, "OMP_NUM_THREADS")}}
