"""A synthetic agentic multi-turn workload: long sessions of tool rounds with short answers.

An agent session (a coding or research assistant calling tools) is a task followed by many
rounds: each round sends what came back since the last answer (the user's next instruction or
a tool's output) and the model answers briefly (a tool call, a short reply). Compared with
chat data sets (ShareGPT: ~5 turns, ~355 output tokens a turn in our trace), the sessions are
long and the answers short, so most of each turn's context is history -- the regime in which
keeping a conversation's KV between turns matters most.

:func:`agentic_workload` draws sessions with these statistics (deterministic for a seed):

- **turns** per session: ``round(lognormal(ln 12, 0.3))`` clipped to ``[8, 24]``: median 12,
  mean ~12.5.
- **new input** per turn: the first turn (task, instructions) lognormal with median 350,
  sigma 0.4; later turns are a tool output with probability 0.3 (lognormal, median 400,
  sigma 0.7: logs, file contents, search results -- the heavy tail) and a short message
  otherwise (median 200, sigma 0.45); clipped to ``[16, 4096]``. Mean ~315 tokens a turn.
- **answer** per turn: lognormal with median 100, sigma 0.3, clipped to ``[60, 220]``:
  mean ~105 tokens.
- **context**: a median session ends past 5k tokens (a 24-turn one past 10k). A session whose
  context would exceed ``max_context`` is cut after its last turn that fits (counted in
  ``counts["truncated"]``).

The time between a session's turns (the tool running, the user reading) is the load
generator's think time (``--think-time``, exponential), not part of the workload: a few
seconds suits agents. Sessions then live about ``turns x (think time + turn latency)``:
~12.5 x (5 s + ~2 s) = ~90 s at a 5 s mean think time on an H200, which is the least warm-up
a steady-state point needs (:func:`session_lifetime_s`).
"""

from __future__ import annotations

import math
import random

from pensieve.bench.workload_types import (
    DEFAULT_MAX_CONTEXT,
    Conversation,
    Turn,
    Workload,
    draw_sessions,
)

AGENTIC_MEDIAN_TURNS = 12
AGENTIC_TURNS_SIGMA = 0.3
AGENTIC_MIN_TURNS = 8
AGENTIC_MAX_TURNS = 24
AGENTIC_FIRST_INPUT_MEDIAN = 350
AGENTIC_FIRST_INPUT_SIGMA = 0.4
AGENTIC_INPUT_MEDIAN = 200
AGENTIC_INPUT_SIGMA = 0.45
AGENTIC_TOOL_PROB = 0.3
AGENTIC_TOOL_MEDIAN = 400
AGENTIC_TOOL_SIGMA = 0.7
AGENTIC_MIN_INPUT = 16
AGENTIC_MAX_INPUT = 4096
AGENTIC_OUTPUT_MEDIAN = 100
AGENTIC_OUTPUT_SIGMA = 0.3
AGENTIC_MIN_OUTPUT = 60
AGENTIC_MAX_OUTPUT = 220


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def agentic_session(rng: random.Random, conv_id: str, max_context: int | None
                    ) -> tuple[Conversation, bool]:
    """One session drawn from ``rng``; also whether it was cut to fit ``max_context``."""
    n = _lognormal(rng, AGENTIC_MEDIAN_TURNS, AGENTIC_TURNS_SIGMA, AGENTIC_MIN_TURNS,
                   AGENTIC_MAX_TURNS)
    turns: list[Turn] = []
    context = 0
    cut = False
    for k in range(n):
        if k == 0:
            inp = _lognormal(rng, AGENTIC_FIRST_INPUT_MEDIAN, AGENTIC_FIRST_INPUT_SIGMA,
                             AGENTIC_MIN_INPUT, AGENTIC_MAX_INPUT)
        elif rng.random() < AGENTIC_TOOL_PROB:
            inp = _lognormal(rng, AGENTIC_TOOL_MEDIAN, AGENTIC_TOOL_SIGMA, AGENTIC_MIN_INPUT,
                             AGENTIC_MAX_INPUT)
        else:
            inp = _lognormal(rng, AGENTIC_INPUT_MEDIAN, AGENTIC_INPUT_SIGMA, AGENTIC_MIN_INPUT,
                             AGENTIC_MAX_INPUT)
        out = _lognormal(rng, AGENTIC_OUTPUT_MEDIAN, AGENTIC_OUTPUT_SIGMA, AGENTIC_MIN_OUTPUT,
                         AGENTIC_MAX_OUTPUT)
        if max_context is not None and context + inp + out > max_context and turns:
            cut = True  # the draws of the remaining turns are skipped: later sessions shift
            break
        turns.append(Turn(inp, out))
        context += inp + out
    return Conversation(conv_id, turns), cut


def agentic_workload(num_sessions: int, seed: int = 0,
                     max_context: int | None = DEFAULT_MAX_CONTEXT) -> Workload:
    """``num_sessions`` agentic sessions (see the module doc), deterministic for ``seed``."""
    convs, counts = draw_sessions(agentic_session, num_sessions, seed, "agentic", max_context)
    notes = (f"synthetic agentic sessions: turns lognormal(median {AGENTIC_MEDIAN_TURNS}, sigma "
             f"{AGENTIC_TURNS_SIGMA}) in [{AGENTIC_MIN_TURNS}, {AGENTIC_MAX_TURNS}]; input: first "
             f"turn median {AGENTIC_FIRST_INPUT_MEDIAN}, then tool output (p={AGENTIC_TOOL_PROB}, "
             f"median {AGENTIC_TOOL_MEDIAN}) or message (median {AGENTIC_INPUT_MEDIAN}); answer "
             f"median {AGENTIC_OUTPUT_MEDIAN} in [{AGENTIC_MIN_OUTPUT}, {AGENTIC_MAX_OUTPUT}]; "
             f"seed {seed}; max_context={max_context}")
    return Workload("Agentic", convs, source="synthetic", notes=notes, counts=counts)


def session_lifetime_s(conversations: list[Conversation], think_time_s: float,
                       s_per_output_token: float = 0.02, ttft_s: float = 0.2) -> float:
    """Mean time a session is in flight: per turn a latency (``ttft_s`` plus
    ``s_per_output_token`` per answer token; 20 ms/token is a loaded H200 decoding a 13B
    model) and, between turns, one mean think time. A steady-state warm-up needs at least
    this long for the number of sessions in flight to level off."""
    if not conversations:
        return 0.0
    total = 0.0
    for c in conversations:
        total += sum(ttft_s + s_per_output_token * t.output_len for t in c.turns)
        total += think_time_s * max(len(c.turns) - 1, 0)
    return total / len(conversations)


__all__ = ["agentic_workload", "agentic_session", "session_lifetime_s"]
