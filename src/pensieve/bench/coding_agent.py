"""Long-context agent workloads: coding-agent sessions, alone or mixed with short chats.

A coding agent (an IDE assistant, a terminal agent) opens with a large system prompt and tool
schema, then alternates a tool call (the model's short reply) with the tool's output (a file, a
diff, a test log: hundreds to thousands of tokens). Its context grows to tens of thousands of
tokens, so recomputing a session's history costs orders of magnitude more than a chat's --
the regime where the order in which a cache keeps conversations can matter.

:func:`coding_agent_workload` draws sessions with these statistics (deterministic for a seed):

- **turns** per session: uniform integer in ``[10, 40]`` (mean 25).
- **first turn**: the system prompt and tool schema, uniform in ``[2000, 6000]`` tokens, plus
  the task (lognormal, median 150, sigma 0.5, clipped to ``[20, 1000]``).
- **later turns**: a tool output, lognormal with median 1,200 and sigma 1.0 clipped to
  ``[200, 8000]`` (heavy-tailed: P50 ~1.2k, P90 ~4.3k, ~3% at the 8k cap; mean ~1.8k).
- **reply** per turn: lognormal, median 100, sigma 0.6, clipped to ``[30, 300]`` (mean ~115).
- **context**: a median session ends near 50k tokens (P10 ~27k, P90 ~78k, 80% past 32k,
  the longest of 2,000 near 117k); sessions that would pass
  ``max_context`` (default 131,072) are cut after their last turn that fits
  (``counts["truncated"]``).

The time between turns (the tool running, the agent's harness) is the load generator's think
time, exponential with mean ``--think-time``: :data:`AGENT_THINK_TIME_S` (6 s) puts 81% of the
gaps between 1 and 20 s.

:func:`agent_mix_workload` is the mixed load: each conversation is a coding-agent session with
probability ``agent_share`` (default :data:`AGENT_SHARE`, 0.2) and otherwise a short chat with
our ShareGPT trace's statistics (``1 + Poisson(4.13)`` turns, lognormal inputs of mean 79 and
answers of mean 355 tokens, drawn as the UltraChat generator draws its own:
:func:`sharegpt_like_chat`). By tokens the agents dominate (a session ~52k tokens against
~2.2k for a chat), by sessions the chats do, so the cache holds conversations whose
recomputation costs differ by 20-60x.
"""

from __future__ import annotations

import math
import random

from pensieve.bench.workload_types import Conversation, Turn, Workload, draw_sessions

AGENT_MAX_CONTEXT = 131072
"""Sessions are cut to fit this many tokens (the llama3.1-8b context)."""
AGENT_MIN_TURNS, AGENT_MAX_TURNS = 10, 40
AGENT_SYSTEM_TOKENS = (2000, 6000)
AGENT_TASK = (150, 0.5, 20, 1000)
"""Median, sigma, min, max of the first turn's task message (tokens)."""
AGENT_TOOL = (1200, 1.0, 200, 8000)
"""Median, sigma, min, max of a tool output (tokens)."""
AGENT_REPLY = (100, 0.6, 30, 300)
"""Median, sigma, min, max of the model's reply (tokens)."""
AGENT_THINK_TIME_S = 6.0
"""The mean think time (exponential) the load generator should use with these sessions."""
AGENT_SHARE = 0.2
"""The mixed load's share of coding-agent sessions (the rest are short chats)."""
SHAREGPT_MEAN_TURNS, SHAREGPT_MEAN_INPUT, SHAREGPT_MEAN_OUTPUT = 5.13, 79.2, 355.2
"""Our ShareGPT trace's means (docs/benchmarks.md, Workloads): the mixed load's chats."""


def _lognormal(rng: random.Random, spec: tuple[float, float, int, int]) -> int:
    median, sigma, lo, hi = spec
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def coding_agent_session(rng: random.Random, conv_id: str, max_context: int | None
                         ) -> tuple[Conversation, bool]:
    """One session drawn from ``rng``; also whether it was cut to fit ``max_context``. All of
    a session's draws are made before the cut, so a cut never shifts later sessions."""
    n = rng.randint(AGENT_MIN_TURNS, AGENT_MAX_TURNS)
    first = rng.randint(*AGENT_SYSTEM_TOKENS) + _lognormal(rng, AGENT_TASK)
    ins = [first] + [_lognormal(rng, AGENT_TOOL) for _ in range(n - 1)]
    outs = [_lognormal(rng, AGENT_REPLY) for _ in range(n)]
    turns: list[Turn] = []
    context = 0
    for inp, out in zip(ins, outs):
        if max_context is not None and context + inp + out > max_context and turns:
            return Conversation(conv_id, turns), True
        turns.append(Turn(inp, out))
        context += inp + out
    return Conversation(conv_id, turns), False


def coding_agent_workload(num_sessions: int, seed: int = 0,
                          max_context: int | None = AGENT_MAX_CONTEXT) -> Workload:
    """``num_sessions`` coding-agent sessions (see the module doc), deterministic for
    ``seed``."""
    convs, counts = draw_sessions(coding_agent_session, num_sessions, seed, "agent", max_context)
    notes = (f"synthetic coding-agent sessions: turns U[{AGENT_MIN_TURNS}, {AGENT_MAX_TURNS}]; "
             f"system + tools U{list(AGENT_SYSTEM_TOKENS)} + task lognormal{AGENT_TASK}; tool "
             f"output lognormal(median, sigma, lo, hi) {AGENT_TOOL}; reply {AGENT_REPLY}; "
             f"think time: exponential, mean {AGENT_THINK_TIME_S} s (load generator); "
             f"seed {seed}; max_context={max_context}")
    return Workload("CodingAgent", convs, source="synthetic", notes=notes, counts=counts)


def _poisson(rng: random.Random, lam: float) -> int:
    """A Poisson draw (Knuth's product of uniforms; ``lam`` is small here)."""
    limit, k, p = math.exp(-lam), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def sharegpt_like_chat(rng: random.Random) -> list[Turn]:
    """The turns of one short chat with our ShareGPT trace's means: ``1 + Poisson(4.13)``
    turns; inputs and answers lognormal with means 79.2 and 355.2 tokens (sigma 1.0 and 0.6,
    as :func:`pensieve.bench.workload.ultrachat_synthetic` draws them), at least 1 token."""
    def draw(mean: float, sigma: float) -> int:
        return max(1, round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))

    n = 1 + _poisson(rng, SHAREGPT_MEAN_TURNS - 1.0)
    return [Turn(draw(SHAREGPT_MEAN_INPUT, 1.0), draw(SHAREGPT_MEAN_OUTPUT, 0.6))
            for _ in range(n)]


def agent_mix_workload(num_conversations: int, seed: int = 0,
                       agent_share: float = AGENT_SHARE,
                       max_context: int | None = AGENT_MAX_CONTEXT) -> Workload:
    """``num_conversations`` conversations, each a coding-agent session with probability
    ``agent_share`` and a ShareGPT-like chat otherwise (see the module doc); deterministic for
    ``seed``. Agents are named ``agent-<i>``, chats ``chat-<i>``, ``i`` the position."""
    if num_conversations < 0:
        raise ValueError(f"num_conversations must be >= 0, got {num_conversations}")
    if not 0.0 <= agent_share <= 1.0:
        raise ValueError(f"agent_share must be in [0, 1], got {agent_share}")
    rng = random.Random(seed)
    is_agent = [rng.random() < agent_share for _ in range(int(num_conversations))]
    num_agents = sum(is_agent)
    agents = iter(coding_agent_workload(num_agents, seed + 1, max_context).conversations)
    chat_rng = random.Random(seed + 2)
    chats = iter(lambda: sharegpt_like_chat(chat_rng), None)
    convs = [Conversation(f"agent-{i}", next(agents).turns) if a
             else Conversation(f"chat-{i}", next(chats)) for i, a in enumerate(is_agent)]
    notes = (f"mixed: coding-agent sessions with probability {agent_share} (seed {seed + 1}), "
             f"else ShareGPT-like chats (1+Poisson({SHAREGPT_MEAN_TURNS - 1:.2f}) turns, input "
             f"mean {SHAREGPT_MEAN_INPUT}, output mean {SHAREGPT_MEAN_OUTPUT}; seed {seed + 2}); "
             f"seed {seed}; max_context={max_context}")
    counts = {"drawn": len(convs), "kept": len(convs), "agents": num_agents,
              "chats": len(convs) - num_agents}
    return Workload("AgentMix", convs, source="synthetic", notes=notes, counts=counts)


__all__ = ["coding_agent_workload", "coding_agent_session", "agent_mix_workload",
           "AGENT_THINK_TIME_S", "AGENT_SHARE", "AGENT_MAX_CONTEXT"]
