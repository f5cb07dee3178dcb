"""A request: one turn's context (history + new input), its outputs, and what is left to compute.

``pending`` lists, in position order, the position intervals whose KV the turn still has to
compute: recomputation of dropped chunks first, then the tail from the conversation's
``kv_end`` to ``num_tokens``. The last interval always ends at ``num_tokens``; a token is
sampled when a step empties ``pending``, and the new token's position becomes pending.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pensieve.core.outputs import QueryRange, TokenLogprobs
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.stats import CacheStats


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


@dataclass(eq=False)
class Request:
    """State of one generation request, owned by the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    eos_token_ids: tuple[int, ...] = ()
    """End-of-sequence ids of the model (ignored with ``ignore_eos``)."""
    conversation_id: str | None = None
    """The conversation this turn belongs to (None: a one-off request)."""
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    """With ``sampling_params.logprobs`` set: one entry per output token (None where the
    executor computed none, e.g. the simulator). Appended by the engine."""
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    """With ``sampling_params.prompt_logprobs`` set: by position, the prompt tokens'
    log-probabilities the executor computed. Filled by the engine."""
    pending: list[tuple[int, int]] = field(default_factory=list)
    cache_stats: CacheStats = field(default_factory=CacheStats)
    status: RequestStatus = RequestStatus.WAITING
    first_token_time: float | None = None
    finish_time: float | None = None
    share_salt: bytes = b""
    """Seed of this turn's chunk hashes: equal salts may share blocks
    (:func:`pensieve.core.prefix_share.share_salt`)."""
    share_hashes: list[bytes] | None = None
    """Chained hashes of the turn's full chunks as far as computed (None: not yet)."""
    deferrals: int = 0
    """Steps this turn's admission waited for background swap-outs to free its blocks
    (``TieredKVCache.defer_admission``)."""

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: empty prompt")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending(self) -> int:
        return sum(hi - lo for lo, hi in self.pending)

    def pending_end(self, n: int) -> int:
        """Position after the last of the first ``n`` pending tokens."""
        for lo, hi in self.pending:
            if n <= hi - lo:
                return lo + n
            n -= hi - lo
        raise ValueError(f"request {self.request_id}: fewer than {n} tokens pending")

    def take(self, n: int) -> list[QueryRange]:
        """Remove the first ``n`` pending tokens; they become this step's query ranges. A
        step never schedules a request with nothing to compute: ``n`` must be positive."""
        if n <= 0:
            raise ValueError(f"request {self.request_id}: a step takes {n} tokens")
        ranges: list[QueryRange] = []
        while n > 0:
            lo, hi = self.pending[0]
            m = min(n, hi - lo)
            ranges.append(QueryRange(lo, self.token_ids_range(lo, lo + m)))
            if m == hi - lo:
                self.pending.pop(0)
            else:
                self.pending[0] = (lo + m, hi)
            n -= m
        return ranges

    def append_output(self, token: int) -> None:
        """A sampled token: its KV is the next thing to compute."""
        self.output_token_ids.append(token)
        n = self.num_tokens
        self.pending.append((n - 1, n))

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_range(self, start: int, end: int) -> list[int]:
        """Tokens at positions ``[start, end)`` of prompt + output, without copying it all."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
