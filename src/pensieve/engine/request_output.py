"""What the engine returns for a finished request (no torch: the benchmark and the simulator
use it too)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pensieve.core.outputs import TokenLogprobs


@dataclass
class RequestOutput:
    """A finished request."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str | None
    text: str | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    conversation_id: str | None = None
    cache_stats: dict[str, int] | None = None
    """Where this turn's context came from (gpu / cpu hits, recomputed, new) and moves."""
    error: str | None = None
    """Why the request failed (``finish_reason == "error"``): the exception its execution
    raised. Its conversation is as it was before the turn."""
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    """With ``SamplingParams.logprobs`` set: one entry per output token (None where the
    executor computed none); empty otherwise."""
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    """With ``SamplingParams.prompt_logprobs`` set: one entry per prompt token (None for the
    first, and where this turn computed none: a cached prefix); empty otherwise."""


__all__ = ["RequestOutput"]
