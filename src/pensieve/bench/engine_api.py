"""What the load generator needs from a system under test, and the clocks it runs on.

Four kinds of system implement :class:`BenchEngine`: Pensieve's :class:`LLMEngine` (any cache
policy, on a real device), the simulator (the same scheduler and cache, virtual time advanced
by a calibrated step-cost model), the HF transformers continuous-batching peer and a server
over HTTP (:mod:`pensieve.bench.http_engine`).

:func:`engine_probe` reads the state the load generator samples once a second to show whether
a run is at steady state: KV blocks used per tier, requests running and waiting.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from pensieve.core.sampling_params import SamplingParams
from pensieve.engine.request_output import RequestOutput


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on this clock."""
        ...

    def sleep_until(self, t: float) -> None:
        """Wait (or jump) until ``now() >= t``."""
        ...


class WallClock:
    """Real time (``time.monotonic``)."""

    def now(self) -> float:
        return time.monotonic()

    def sleep_until(self, t: float) -> None:
        dt = t - time.monotonic()
        if dt > 0:
            time.sleep(dt)


class VirtualClock:
    """Simulated time: only moves when told to."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        if dt < 0:
            raise ValueError(f"time cannot go back ({dt})")
        self.t += dt

    def sleep_until(self, t: float) -> None:
        self.t = max(self.t, t)


class BenchEngine(Protocol):
    """A system the load generator can drive, one step at a time. It reads time from the
    same :class:`Clock` the load generator is given (``LLMEngine(config, clock=clock.now)``)."""

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None,
                    conversation_id: str | None = None) -> None:
        """Queue a turn. With a conversation id the prompt is the *new* input only; the
        system prepends the conversation's history (and may reuse its KV)."""
        ...

    def has_unfinished(self) -> bool:
        ...

    def step(self) -> list[RequestOutput]:
        """Advance by one iteration; returns requests finished in it, with timestamps on
        ``clock`` (``arrival_time``, ``first_token_time``, ``finish_time``) and, where the
        system knows them, ``cache_stats``."""
        ...

    def cache_stats(self) -> dict[str, int]:
        ...


PROBE_KEYS = ("gpu_blocks_used", "gpu_blocks_total", "cpu_blocks_used", "cpu_blocks_total",
              "requests_running", "requests_waiting", "swap_in_bytes", "swap_out_bytes",
              "dropped_tokens")
"""What :func:`engine_probe` reports where the system knows it (the last three are running
totals since the engine started)."""


def engine_probe(engine: Any) -> dict[str, float]:
    """The engine's state now, cheaply: the engine's own ``probe()`` if it has one (the HTTP
    engine returns its latest scrape of the server's ``/metrics``), else blocks per tier and
    swap / drop totals from ``cache_stats()`` and requests from ``num_running`` /
    ``num_waiting`` (Pensieve's engine and the simulator). Missing values are left out."""
    probe = getattr(engine, "probe", None)
    if callable(probe):
        return dict(probe())
    out: dict[str, float] = {}
    stats = getattr(engine, "cache_stats", None)
    st = stats() if callable(stats) else {}
    for tier in ("gpu", "cpu"):
        total = st.get(f"{tier}_blocks_total")
        free = st.get(f"{tier}_blocks_free")
        if total is not None and free is not None:
            out[f"{tier}_blocks_used"] = total - free
            out[f"{tier}_blocks_total"] = total
    for key in ("swap_in_bytes", "swap_out_bytes", "dropped_tokens"):
        if key in st:
            out[key] = st[key]
    for key, attr in (("requests_running", "num_running"), ("requests_waiting", "num_waiting")):
        v = getattr(engine, attr, None)
        if isinstance(v, int):
            out[key] = v
    if "requests_running" not in out and "running_requests" in st:  # the HF peer
        out["requests_running"] = st["running_requests"]
    return out
