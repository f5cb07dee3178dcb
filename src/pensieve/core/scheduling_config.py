"""Frozen configuration of the scheduling core. Built without I/O; derived values are methods."""

from __future__ import annotations

from dataclasses import dataclass

BATCHING_MODES = ("unified", "separate")
"""Values of :attr:`SchedulerConfig.batching`."""

STEP_TOKEN_BUDGETS = {"cuda": 8192, "cpu": 256}
"""Default ``max_num_batched_tokens`` per device type: what keeps one step near 100-200 ms of
compute there (every running stream waits for the whole step). On the CPU (2 cores, the
default model) a 256-token prefill chunk is such a step; a long prompt is chunked over steps
that its neighbours' decodes share. Other device types take the CPU's."""


STEP_ATTENTION_SPANS = {"cuda": 16384, "cpu": 2048}
"""Default ``prefill_attention_pairs`` per device type, per token of the step budget: the
context up to which a full-budget prefill piece keeps its size. On the H200 (llama3.1-8b)
attention is cheap next to the rest up to ~16k; on the CPU a 256-token piece at 8k of context
took 1.5 s against 0.43 s at the start (docs/performance.md), so pieces shrink past 2k."""


STEP_TIME_TARGETS = {"cuda": 0.0, "cpu": 2.0}
"""Default ``step_time_target_s`` per device type (other types take the CPU's). On CUDA a
full-budget step takes tens to hundreds of ms whatever else the host runs: no target. On the
CPU a 256-token piece took 0.43-1.5 s on a quiet 2-core machine and 2.5-3 s beside other
processes (docs/performance.md): the target keeps a running stream's wait for its next token
near 2 s there on a busy host, and leaves a quiet one's pieces whole."""


def default_step_time_target(device_type: str) -> float:
    """The step time target for ``device_type`` when none is given (0.0: none)."""
    return STEP_TIME_TARGETS.get(device_type, STEP_TIME_TARGETS["cpu"])


def default_prefill_attention_pairs(device_type: str, max_num_batched_tokens: int) -> int:
    """The step's prefill attention budget for ``device_type`` when none is given."""
    span = STEP_ATTENTION_SPANS.get(device_type, STEP_ATTENTION_SPANS["cpu"])
    return max_num_batched_tokens * span


def default_max_num_batched_tokens(device_type: str) -> int:
    """The step token budget for ``device_type`` (``cuda``, ``cpu``, ...) when none is given:
    the one place the engine's entry points settle it."""
    return STEP_TOKEN_BUDGETS.get(device_type, STEP_TOKEN_BUDGETS["cpu"])


def step_time_help() -> str:
    """The ``--step-time-target-s`` help text of the command lines."""
    per_device = ", ".join(f"{t:g} s on {d}" if t else f"none on {d}"
                           for d, t in STEP_TIME_TARGETS.items())
    return ("longest a step with prompt work should take, in seconds; on a slow or busy host "
            f"a long prompt then goes in smaller pieces (0: none; default: the device's; "
            f"{per_device})")


def budget_help() -> str:
    """The ``--max-num-batched-tokens`` help text of the command lines."""
    per_device = ", ".join(f"{n} on {d}" for d, n in STEP_TOKEN_BUDGETS.items())
    return f"token budget of one step (default: the device's; {per_device})"


DEFAULT_MAX_MODEL_LEN = 16384
"""``max_model_len`` of ``LLM()`` and of a model whose config states no
``max_position_embeddings``; the command lines take the model's own limit
(:func:`pensieve.options.settle_model_options`)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduling step."""

    max_num_batched_tokens: int = STEP_TOKEN_BUDGETS["cuda"]
    """Token budget of one step: prefill and decode tokens together. The engine's entry
    points (``LLM``, ``pensieve serve``) default it per device
    (:func:`default_max_num_batched_tokens`); this default is CUDA's."""
    max_num_seqs: int = 256
    """Most requests running (holding KV and decoding) at once."""
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    """Longest context (prompt + output) a request may reach."""
    enable_chunked_prefill: bool = True
    """Split a long prompt over several steps instead of waiting for a budget that fits it."""
    batching: str = "unified"
    """``unified``: each step mixes decodes, continuing prefills and newly admitted prompts under
    one token budget. ``separate`` (vLLM 0.2 style, the paper's Figure 13 baseline): a step runs
    prefill work only or decodes only, prefills first whenever there are any."""
    swap_in_ahead_chunks: int = 256
    """Unified batches: a turn admitted with chunks to swap in, into a step that has other
    work, has them copied during that step and computes from the next step on, so no step's
    compute waits for them; at most this many chunks a step go ahead (a turn beyond that
    computes in its admission step, each layer waiting for its swap-ins). 0: never ahead.

    The copies ahead are the step's ``SwapPlan.swap_in_ahead``."""

    prefill_attention_pairs: int | None = None
    """Most (query token, KV position) pairs that a step's prefill may attend over, the part
    of a step's time that grows with context: a piece of n prompt tokens from position p
    counts n * (p + n / 2). Long turns are then prefilled in smaller pieces as their context
    grows, so no step (and no running decode's next token) waits for a whole
    max_num_batched_tokens chunk at 100k context (default: max_num_batched_tokens times
    16384 on CUDA, 2048 on the CPU, which leaves contexts up to ~16k and ~2k untouched;
    docs/long_context.md).

    None here is ``max_num_batched_tokens * 16384``; the engine's entry points give each
    device its own (:data:`STEP_ATTENTION_SPANS`)."""

    step_time_target_s: float = 0.0
    """Longest a step with prompt work should take, in seconds (0: no target). Every running
    stream waits for the whole step: on a slow or busy host a long prompt then goes in
    smaller pieces, so the others keep streaming.

    After each step the scheduler sets the next step's token budget to what this time allows
    at the measured time of a step and of a prompt token, within max_num_batched_tokens
    (:meth:`~pensieve.core.scheduler.Scheduler.observe_step`). The engine's entry points
    give each device its own (:data:`STEP_TIME_TARGETS`: the CPU 2 s, CUDA none)."""

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
        if not self.step_time_target_s >= 0.0:  # NaN too
            raise ValueError(f"step_time_target_s must be >= 0, got {self.step_time_target_s}")
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
