"""Per-request sampling and stopping parameters (pure Python, validated on construction)."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

_INT32_MAX = 2**31 - 1
_INT63_MAX = 2**63 - 1
SAMPLING_EPS = 1e-5
"""Temperatures below this count as 0 (greedy), as vLLM's ``_SAMPLING_EPS``: dividing the
logits by a tinier one (1e-300, a denormal) overflows them to inf and samples garbage."""
MAX_LOGPROBS = 20
"""Most alternatives per token that ``logprobs`` may ask for (OpenAI's limit)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` means greedy; so does any temperature below :data:`SAMPLING_EPS`
    (it is stored as 0). ``top_k <= 0`` disables top-k; ``top_p == 1`` disables
    nucleus sampling. With a ``seed`` the sampled tokens depend only on the seed, the logits and
    the index of the output token, never on which other requests share the batch.
    """

    max_tokens: int = 16
    """Most tokens to generate for this request."""
    temperature: float = 1.0
    """Softmax temperature; 0 (or anything below ``SAMPLING_EPS``) selects greedy decoding."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 or negative: off)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p (1.0: off)."""
    seed: int | None = None
    """Per-request seed for reproducible sampling."""
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """Generation stops after emitting any of these (the token is kept in the output)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (benchmarks)."""
    logprobs: int | None = None
    """Return each sampled token's log-probability and this many most likely alternatives
    (0..20; None: no log-probabilities). They are the model's: a log-softmax of the logits
    before temperature, top-k and top-p, as vLLM returns them by default."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature < SAMPLING_EPS:
            object.__setattr__(self, "temperature", 0.0)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k <= _INT32_MAX:
            raise ValueError(f"top_k must be an int in [-1, {_INT32_MAX}] (<= 0: off), "
                             f"got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int)
                                      or not 0 <= self.seed <= _INT63_MAX):
            raise ValueError(f"seed must be an int in [0, {_INT63_MAX}], got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an int in [0, {MAX_LOGPROBS}] or None, "
                             f"got {self.logprobs!r}")
        try:
            stops = tuple(operator.index(t) for t in self.stop_token_ids)
        except TypeError as e:
            raise ValueError(f"stop_token_ids must be ints: {e}") from None
        if not all(0 <= t <= _INT63_MAX for t in stops):
            raise ValueError(f"stop_token_ids must be ints in [0, {_INT63_MAX}]")
        object.__setattr__(self, "stop_token_ids", stops)

    @property
    def greedy(self) -> bool:
        """True when the argmax token is always taken."""
        return self.temperature == 0.0
