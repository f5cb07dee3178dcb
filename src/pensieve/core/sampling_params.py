"""Per-request sampling and stopping parameters (pure Python, validated on construction)."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from functools import cached_property

_INT32_MAX = 2**31 - 1
_INT63_MAX = 2**63 - 1
SAMPLING_EPS = 1e-5
"""Temperatures below this count as 0 (greedy), as vLLM's ``_SAMPLING_EPS``: dividing the
logits by a tinier one (1e-300, a denormal) overflows them to inf and samples garbage."""
MAX_LOGPROBS = 20
"""Most alternatives per token that ``logprobs`` may ask for (OpenAI's limit)."""
MAX_PENALTY = 2.0
"""Bound of ``presence_penalty`` and ``frequency_penalty`` (OpenAI's: [-2, 2])."""
MAX_LOGIT_BIAS = 100.0
"""Bound of a ``logit_bias`` value (OpenAI's: [-100, 100])."""

GRAMMAR_KINDS = ("json_schema", "json_object", "structural_tag")


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on a request's output, as text (so it pickles to an engine process and
    keys the compiled-grammar cache): ``kind`` is one of :data:`GRAMMAR_KINDS`; ``source`` is
    the JSON schema, ``""`` for any JSON object, or an xgrammar structural tag (JSON)."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` means greedy; so does any temperature below :data:`SAMPLING_EPS`
    (it is stored as 0). ``top_k <= 0`` disables top-k; ``top_p == 1`` disables
    nucleus sampling. The logits processors (``logit_bias``, ``min_tokens``, the three
    penalties) change the logits before greedy or random picking, as vLLM orders them; ``min_p``
    then filters after temperature. With a ``seed`` the sampled tokens depend only on the seed,
    the logits and the index of the output token, never on which other requests share the
    batch.
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
    prompt_logprobs: int | None = None
    """Also return each prompt token's log-probability (after the first) and this many most
    likely alternatives (0..20; None: none), from the prefill that computes the prompt's KV.
    Only positions this turn computes get one (a cached prefix has none)."""
    priority: int = 0
    """vLLM's scheduling priority: a waiting turn is admitted before every waiting turn of a
    larger value (lower first; equal values in arrival order). It orders admission only: a
    running turn is not preempted for a waiting one of a lower value."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already in the output ([-2, 2])."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it occurs in the output ([-2, 2])."""
    repetition_penalty: float = 1.0
    """HF/CTRL penalty over prompt and output tokens: a positive logit is divided by it, a
    negative one multiplied (> 0; 1: off)."""
    min_tokens: int = 0
    """End-of-sequence and stop token ids are masked until this many tokens are generated."""
    min_p: float = 0.0
    """Drop tokens whose probability (after temperature) is below ``min_p`` times the most
    likely one's ([0, 1]; 0: off)."""
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    """(token id, bias) pairs added to the logits (a dict is accepted and sorted)."""
    grammar: GrammarSpec | None = None
    """Constrain the output to this grammar (JSON schema, JSON object, tool-call format):
    tokens it does not allow get probability 0 (:mod:`pensieve.runner.grammar`)."""

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
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be an int in [0, {MAX_LOGPROBS}] or None, "
                             f"got {self.prompt_logprobs!r}")
        if (not isinstance(self.priority, int) or isinstance(self.priority, bool)
                or not -_INT63_MAX <= self.priority <= _INT63_MAX):
            raise ValueError(f"priority must be an int, got {self.priority!r}")
        try:
            stops = tuple(operator.index(t) for t in self.stop_token_ids)
        except TypeError as e:
            raise ValueError(f"stop_token_ids must be ints: {e}") from None
        if not all(0 <= t <= _INT63_MAX for t in stops):
            raise ValueError(f"stop_token_ids must be ints in [0, {_INT63_MAX}]")
        object.__setattr__(self, "stop_token_ids", stops)
        self._check_processors()

    def _check_processors(self) -> None:
        """Bounds of the logits processors' fields (OpenAI's and vLLM's)."""
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if not _is_number(rp) or not 0 < rp <= 1e6:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {rp!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if (not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool)
                or not 0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        items = (self.logit_bias.items() if isinstance(self.logit_bias, dict)
                 else self.logit_bias)
        bias: dict[int, float] = {}
        for tok, val in items:
            if not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok <= _INT32_MAX:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {tok!r}")
            if not _is_number(val) or not -MAX_LOGIT_BIAS <= val <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], "
                                 f"got {val!r} for token {tok}")
            bias[tok] = float(val)
        object.__setattr__(self, "logit_bias", tuple(sorted(bias.items())))

    @property
    def greedy(self) -> bool:
        """True when the argmax token is always taken."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when a penalty reads the request's tokens."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @cached_property
    def needs_token_history(self) -> bool:
        """True when the sampler needs the request's tokens (penalties, ``min_tokens``);
        computed once (the scheduler asks for every request it schedules, every step)."""
        return self.has_penalties or self.min_tokens > 0

    @property
    def processes_logits(self) -> bool:
        """True when some processor changes this request's logits before picking."""
        return self.needs_token_history or bool(self.logit_bias)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
