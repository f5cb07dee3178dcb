"""What the load generator needs from a system under test, and the clocks it runs on.

Three kinds of system implement :class:`BenchEngine`: Pensieve's :class:`LLMEngine` (any cache
policy, on a real device), the simulator (the same scheduler and cache, virtual time advanced
by a calibrated step-cost model) and the HF transformers continuous-batching peer.
"""

from __future__ import annotations

import time
from typing import Protocol

from pensieve.core.sampling_params import SamplingParams
from pensieve.engine.outputs import RequestOutput


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
