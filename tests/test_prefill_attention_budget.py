"""Long prompts are prefilled in pieces whose attention work fits a per-step budget
(``SchedulerConfig.prefill_attention_pairs``), so step time stays bounded as contexts grow to
128k, and short contexts are scheduled exactly as before."""

from __future__ import annotations

import pytest

from pensieve.core.cache_config import CacheConfig
from pensieve.core.cost_model import CostModel
from pensieve.core.eviction import get_policy
from pensieve.core.outputs import RunnerOutput
from pensieve.core.request import Request
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.scheduler import Scheduler
from pensieve.core.scheduling_config import SchedulerConfig
from pensieve.core.tiered_cache import TieredKVCache


def _scheduler(cfg: SchedulerConfig, blocks: int = 5000) -> Scheduler:
    cost = CostModel.analytic(32, 32, 8, 128, 4096, 14336)
    cache = TieredKVCache(blocks, 0, cost.chunk_cost,
                          CacheConfig(chunk_size=32, swap_out_threshold=0.25, decode_reserve=0.0,
                                      share_prefixes=False, defer_admission=0),
                          policy=get_policy("gpu-only"))
    return Scheduler(cfg, cache)


def _prefill_pieces(s: Scheduler, prompt: int, decodes: int = 0) -> list[tuple[int, int]]:
    """(start position, tokens) of each step's piece of a ``prompt``-token turn."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    s.add_request(Request("long", list(range(3, 3 + prompt)), params))
    pieces, t = [], 0.0
    while s.has_unfinished():
        out = s.schedule(t)
        sampled = {}
        for r in out.requests:
            if r.request_id == "long":
                pieces += [(q.start_pos, q.query_len) for q in r.ranges]
            if r.sample:
                sampled[r.request_id] = 7
        s.update_from_output(out, RunnerOutput(sampled_token_ids=sampled), t)
        t += 0.1
    return pieces


def test_long_prompt_pieces_shrink_with_context_within_the_budget() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=8192, max_model_len=131072)
    pieces = _prefill_pieces(_scheduler(cfg), 120000)
    assert sum(n for _, n in pieces) == 120000
    budget = cfg.attention_pairs()
    assert budget == 8192 * 16384
    for start, n in pieces:
        assert n * (start + n / 2) <= budget
    # the first pieces are whole budgets; past 16k of context they shrink
    assert pieces[0] == (0, 8192) and pieces[1] == (8192, 8192)
    assert pieces[-1][1] < 1200
    assert [n for _, n in pieces] == sorted((n for _, n in pieces), reverse=True)


def test_short_contexts_unchanged() -> None:
    """Contexts up to 16k: the same 8,192-token pieces as without the budget."""
    capped = _prefill_pieces(_scheduler(SchedulerConfig(max_num_batched_tokens=8192)), 16000)
    free = _prefill_pieces(_scheduler(SchedulerConfig(max_num_batched_tokens=8192,
                                                      prefill_attention_pairs=10**15)), 16000)
    assert capped == free == [(0, 8192), (8192, 7808)]


def test_tiny_budget_still_progresses() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=64, prefill_attention_pairs=10)
    pieces = _prefill_pieces(_scheduler(cfg, blocks=100), 300)
    assert sum(n for _, n in pieces) == 300 and min(n for _, n in pieces) >= 1


def test_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="prefill_attention_pairs"):
        SchedulerConfig(prefill_attention_pairs=0)


def test_entry_points_give_each_device_its_attention_budget() -> None:
    from pensieve.engine.llm import build_engine_config

    cpu = build_engine_config(device="cpu").scheduler
    assert cpu.max_num_batched_tokens == 256 and cpu.attention_pairs() == 256 * 2048
    given = build_engine_config(device="cpu", max_num_batched_tokens=64,
                                prefill_attention_pairs=999).scheduler
    assert given.attention_pairs() == 999
