"""The long-context agent workloads: coding-agent sessions and the mixed load (statistics,
determinism by seed, the context cap, the CLI names)."""

from __future__ import annotations

import statistics

import pytest

from pensieve.bench.coding_agent import agent_mix_workload, coding_agent_workload
from pensieve.bench.commands import WORKLOADS, load_workload
from pensieve.bench.workload import workload_stats


def _pct(xs: list[int], q: float) -> int:
    s = sorted(xs)
    return s[int(q * (len(s) - 1))]


def test_coding_agent_statistics() -> None:
    w = coding_agent_workload(1500, seed=5)
    assert w.name == "CodingAgent" and len(w) == 1500
    turns = [len(c.turns) for c in w.conversations]
    assert min(turns) == 10 and max(turns) == 40  # uniform in [10, 40], both ends drawn
    assert 23 <= statistics.mean(turns) <= 27
    first = [c.turns[0].input_len for c in w.conversations]
    assert min(first) >= 2020 and max(first) <= 7000  # system + tools + task
    assert statistics.mean(first) > 3500
    tools = [t.input_len for c in w.conversations for t in c.turns[1:]]
    assert min(tools) == 200 and max(tools) == 8000  # clipped at both ends
    assert 1000 <= statistics.median(tools) <= 1400
    assert _pct(tools, 0.9) > 3 * statistics.median(tools)  # heavy tail
    replies = [t.output_len for c in w.conversations for t in c.turns]
    assert min(replies) >= 30 and max(replies) <= 300 and 90 <= statistics.mean(replies) <= 140
    ctx = [c.total_tokens for c in w.conversations]
    assert max(ctx) <= 131072
    assert 40_000 <= statistics.median(ctx) <= 60_000
    assert sum(x >= 32_768 for x in ctx) / len(ctx) > 0.7  # most sessions reach 32k
    assert _pct(ctx, 0.9) > 64_000  # and a tenth passes 64k
    s = workload_stats(w)
    assert s["mean_turn_context"] > 20_000


def test_coding_agent_deterministic_by_seed() -> None:
    a, b = coding_agent_workload(200, seed=9), coding_agent_workload(200, seed=9)
    c = coding_agent_workload(200, seed=10)
    assert [x.turns for x in a.conversations] == [x.turns for x in b.conversations]
    assert [x.turns for x in a.conversations] != [x.turns for x in c.conversations]
    # a prefix of a larger draw: session i does not depend on how many follow
    big = coding_agent_workload(400, seed=9)
    assert [x.turns for x in big.conversations[:200]] == [x.turns for x in a.conversations]


def test_coding_agent_context_cap_cuts_sessions() -> None:
    full = coding_agent_workload(300, seed=1)
    cut = coding_agent_workload(300, seed=1, max_context=32768)
    assert cut.counts["truncated"] > 100
    for f, c in zip(full.conversations, cut.conversations):
        assert c.total_tokens <= 32768 and len(c.turns) >= 1
        assert c.turns == f.turns[:len(c.turns)]  # cut after a turn, not redrawn
        if c.total_tokens < f.total_tokens:
            nxt = f.turns[len(c.turns)]
            assert c.total_tokens + nxt.input_len + nxt.output_len > 32768
    with pytest.raises(ValueError):
        coding_agent_workload(-1)


def test_agent_mix_ratio_and_determinism() -> None:
    w = agent_mix_workload(2000, seed=4)
    agents = [c for c in w.conversations if c.conv_id.startswith("agent-")]
    chats = [c for c in w.conversations if c.conv_id.startswith("chat-")]
    assert len(agents) + len(chats) == 2000 == len(w)
    assert 0.17 <= len(agents) / 2000 <= 0.23 and w.counts["agents"] == len(agents)
    assert statistics.mean(len(c.turns) for c in chats) == pytest.approx(5.13, abs=0.3)
    chat_ctx = statistics.mean(c.total_tokens for c in chats)
    agent_ctx = statistics.mean(c.total_tokens for c in agents)
    assert 1500 <= chat_ctx <= 3000 and agent_ctx > 15 * chat_ctx
    again = agent_mix_workload(2000, seed=4)
    assert [(c.conv_id, c.turns) for c in again.conversations] == \
        [(c.conv_id, c.turns) for c in w.conversations]
    other = agent_mix_workload(2000, seed=5)
    assert [c.turns for c in other.conversations] != [c.turns for c in w.conversations]
    none = agent_mix_workload(50, seed=0, agent_share=0.0)
    assert all(c.conv_id.startswith("chat-") for c in none.conversations)
    with pytest.raises(ValueError):
        agent_mix_workload(10, agent_share=1.5)


def test_workload_names_resolve() -> None:
    assert {"coding-agent", "agent-mix"} <= set(WORKLOADS)
    assert load_workload("coding-agent", 30, 2).name == "CodingAgent"
    assert load_workload("agent-mix", 30, 2).name == "AgentMix"
    assert [c.turns for c in load_workload("coding-agent", 30, 2).conversations] == \
        [c.turns for c in coding_agent_workload(30, seed=2).conversations]


def test_workload_stats_cli_reports_agent_loads(capsys: pytest.CaptureFixture[str]) -> None:
    from pensieve.bench.workload import main

    assert main(["--ultrachat-n", "0", "--agentic-n", "0", "--coding-agent-n", "50",
                 "--agent-mix-n", "50", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"CodingAgent"' in out and '"AgentMix"' in out
