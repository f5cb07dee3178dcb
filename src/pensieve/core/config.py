"""Frozen configuration of the scheduling core. Built without I/O; derived values are methods."""

from __future__ import annotations

from dataclasses import dataclass

BATCHING_MODES = ("unified", "separate")
"""Values of :attr:`SchedulerConfig.batching`."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduling step."""

    max_num_batched_tokens: int = 8192
    """Token budget of one step: prefill and decode tokens together."""
    max_num_seqs: int = 256
    """Most requests running (holding KV and decoding) at once."""
    max_model_len: int = 16384
    """Longest context (prompt + output) a request may reach."""
    enable_chunked_prefill: bool = True
    """Split a long prompt over several steps instead of waiting for a budget that fits it."""
    batching: str = "unified"
    """``unified``: each step mixes decodes, continuing prefills and newly admitted prompts under
    one token budget. ``separate`` (vLLM 0.2 style, the paper's Figure 13 baseline): a step runs
    prefill work only or decodes only, prefills first whenever there are any."""
    swap_in_ahead_chunks: int = 256
    """Unified batches: a turn admitted with chunks to swap in, into a step that has other
    work, has them copied during that step (``SwapPlan.swap_in_ahead``) and computes from the
    next step on, so no step's compute waits for them; at most this many chunks a step go
    ahead (a turn beyond that computes in its admission step, each layer waiting for its
    swap-ins). 0: never ahead."""

    prefill_attention_pairs: int | None = None
    """Most (query token, KV position) pairs that a step's prefill may attend over, the part
    of a step's time that grows with context: a piece of ``n`` prompt tokens from position
    ``p`` counts ``n * (p + n / 2)``. Long turns are then prefilled in smaller pieces as their
    context grows, so no step (and no running decode's next token) waits for a whole
    ``max_num_batched_tokens`` chunk at 100k context. None: ``max_num_batched_tokens *
    16384``, which leaves contexts up to ~16k untouched (on the H200, llama3.1-8b: a
    60k-token prompt's worst step 0.78 s at 8,192 tokens a piece, 0.21 s at 2,048;
    docs/long_context.md)."""

    def attention_pairs(self) -> int:
        """:attr:`prefill_attention_pairs`, or its default."""
        if self.prefill_attention_pairs is not None:
            return self.prefill_attention_pairs
        return self.max_num_batched_tokens * 16384

    def __post_init__(self) -> None:
        if self.prefill_attention_pairs is not None and self.prefill_attention_pairs < 1:
            raise ValueError(f"prefill_attention_pairs must be >= 1, got "
                             f"{self.prefill_attention_pairs}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.max_model_len < 1:
            raise ValueError(f"scheduler limits must be positive: {self}")
        if self.swap_in_ahead_chunks < 0:
            raise ValueError(
                f"swap_in_ahead_chunks must be >= 0, got {self.swap_in_ahead_chunks}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill max_num_batched_tokens must be >= max_model_len "
                f"({self.max_num_batched_tokens} < {self.max_model_len})"
            )
        if self.batching not in BATCHING_MODES:
            raise ValueError(
                f"batching must be one of {', '.join(BATCHING_MODES)}, got {self.batching!r}")
