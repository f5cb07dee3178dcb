"""The two-tier cache and its policies on hand-built cases, with exact blocks and order."""

from __future__ import annotations

import pytest

from pensieve.core.conversation import Tier
from pensieve.core.eviction import get_policy
from pensieve.core.request import Request
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.tiered_cache import TieredKVCache

C = 4


def cost(context_len: int) -> float:
    return 1.0 + 0.01 * context_len  # grows with context: leading chunks are cheaper


def make(policy: str, gpu: int = 8, cpu: int = 4, threshold: float = 0.5) -> TieredKVCache:
    return TieredKVCache(gpu, cpu, C, get_policy(policy), cost, swap_out_threshold=threshold,
                         decode_reserve=0.0)


def turn(cache: TieredKVCache, cid: str, new: int, now: float, out_token: int = 9) -> Request:
    """Admit a turn of ``new`` input tokens, compute everything, sample one token, end it."""
    conv = cache.conversation(cid)
    req = Request(f"{cid}@{now}", conv.token_ids + [1] * new, SamplingParams(max_tokens=1),
                  conversation_id=cid)
    req.pending = cache.pending_for(req, conv)
    assert cache.admit(req, conv, req.num_tokens, now)
    req.take(req.num_pending)
    req.append_output(out_token)
    cache.end_turn(req, conv, now)
    cache.check_integrity()
    return req


def tiers(cache: TieredKVCache, cid: str) -> list[str]:
    return [ch.tier.value for ch in cache.conversations[cid].chunks]


def test_pensieve_evicts_older_conversation_and_leading_chunks_first() -> None:
    cache = make("pensieve")
    cache.begin_step()
    turn(cache, "A", 12, now=0.0)  # 12 prompt tokens + 1 output: KV for 12 -> 3 chunks
    turn(cache, "B", 12, now=10.0)
    assert cache.block_table(cache.conversations["A"]) == [0, 1, 2]
    assert cache.block_table(cache.conversations["B"]) == [3, 4, 5]
    cache.take_swap_plan()
    # 2 free of 8, threshold 4: two chunks go, the leading ones of the idler conversation
    cache.plan_background(now=20.0)
    plan = cache.take_swap_plan()
    assert plan.swap_out == [(0, 0), (1, 1)] and not plan.swap_out_first
    assert tiers(cache, "A") == ["cpu", "cpu", "gpu"]
    assert tiers(cache, "B") == ["gpu", "gpu", "gpu"]
    assert cache.gpu.num_free_blocks == 2  # reclaimed lazily, at the next step
    cache.check_integrity()
    cache.begin_step()
    assert cache.gpu.num_free_blocks == 4
    assert cache.stats.swapped_out_tokens == 8


def test_cpu_tier_full_drops_lowest_value_chunk() -> None:
    cache = make("pensieve", gpu=8, cpu=2, threshold=0.75)
    cache.begin_step()
    turn(cache, "A", 12, now=0.0)
    turn(cache, "B", 12, now=10.0)
    cache.take_swap_plan()
    # threshold 6 blocks, 2 free: 4 chunks must leave the GPU; the CPU tier holds 2
    cache.plan_background(now=20.0)
    plan = cache.take_swap_plan()
    # A0, A1 to the CPU; then A2 displaces A0 (lower value) which is dropped; then B0
    # (value 1.04/10) is higher than A1's (1.08/20): A1 is dropped to make room for it.
    assert tiers(cache, "A") == ["dropped", "dropped", "cpu"]
    assert tiers(cache, "B") == ["cpu", "gpu", "gpu"]
    # the copies of A0 and A1 were cancelled when they were dropped within the same step
    assert [g for g, _ in plan.swap_out] == [2, 3]
    assert cache.stats.dropped_tokens == 8 and cache.stats.swapped_out_tokens == 8
    cache.check_integrity()


def test_next_turn_recomputes_dropped_swaps_in_cpu_and_hits_gpu() -> None:
    cache = make("pensieve", gpu=8, cpu=2, threshold=0.75)
    cache.begin_step()
    turn(cache, "A", 12, now=0.0)
    turn(cache, "B", 12, now=10.0)
    cache.plan_background(now=20.0)
    cache.take_swap_plan()
    cache.begin_step()
    conv = cache.conversations["A"]  # [dropped][dropped][cpu], kv_end 12, 13 tokens of history
    req = Request("A2", conv.token_ids + [2, 3], SamplingParams(), conversation_id="A")
    req.pending = cache.pending_for(req, conv)
    # recompute positions 0..7, then from kv_end (12) on: the last output and the new input
    assert req.pending == [(0, 8), (12, 15)]
    cpu_block = conv.chunks[2].block
    assert cache.admit(req, conv, 15, now=30.0)
    plan = cache.take_swap_plan()
    assert plan.swap_in == [(cpu_block, conv.chunks[2].block)]
    assert tiers(cache, "A") == ["gpu"] * 4
    st = req.cache_stats
    assert (st.gpu_hit_tokens, st.cpu_hit_tokens, st.recomputed_tokens, st.new_prompt_tokens) == (
        0, 4, 8, 3)
    ranges = req.take(req.num_pending)
    assert [(r.start_pos, r.query_len) for r in ranges] == [(0, 8), (12, 3)]
    cache.check_integrity()


def test_lru_evicts_whole_least_recent_conversation() -> None:
    cache = make("lru")
    cache.begin_step()
    turn(cache, "A", 12, now=0.0)
    turn(cache, "B", 12, now=10.0)
    cache.plan_background(now=20.0)  # needs 2 chunks, takes all 3 of A
    assert [g for g, _ in cache.take_swap_plan().swap_out] == [0, 1, 2]
    assert tiers(cache, "A") == ["cpu"] * 3 and tiers(cache, "B") == ["gpu"] * 3


def test_prefix_lru_evicts_tail_first() -> None:
    cache = make("prefix-lru")
    cache.begin_step()
    turn(cache, "A", 12, now=0.0)
    turn(cache, "B", 12, now=10.0)
    cache.plan_background(now=20.0)
    assert [g for g, _ in cache.take_swap_plan().swap_out] == [2, 1]
    assert tiers(cache, "A") == ["gpu", "cpu", "cpu"]


def test_gpu_only_drops_and_stateless_keeps_nothing() -> None:
    cache = make("gpu-only", gpu=6, cpu=4)
    cache.begin_step()
    assert cache.cpu is None
    turn(cache, "A", 12, now=0.0)
    turn(cache, "B", 12, now=10.0)
    cache.plan_background(now=20.0)  # no CPU tier: nothing ahead of time
    assert cache.take_swap_plan().is_empty
    # a third conversation needs 3 blocks, none free: A's leading chunks are dropped
    turn(cache, "C", 10, now=30.0)
    assert tiers(cache, "A") == ["dropped", "dropped", "dropped"]
    assert cache.stats.dropped_tokens == 12

    st = make("stateless")
    st.begin_step()
    req = turn(st, "A", 12, now=0.0)
    assert st.conversations["A"].chunks == [] and st.gpu.num_free_blocks == 8
    assert st.conversations["A"].token_ids == req.all_token_ids
    req2 = turn(st, "A", 2, now=1.0)
    assert req2.cache_stats.recomputed_tokens == 12 and req2.cache_stats.new_prompt_tokens == 3


def test_suspend_and_abort_keep_the_conversation_consistent() -> None:
    cache = make("pensieve", gpu=8, cpu=8)
    cache.begin_step()
    turn(cache, "A", 6, now=0.0)  # history 7 tokens, kv_end 6
    conv = cache.conversations["A"]
    before = list(conv.token_ids)
    req = Request("A2", conv.token_ids + [5] * 9, SamplingParams(), conversation_id="A")
    req.pending = cache.pending_for(req, conv)
    assert cache.admit(req, conv, 10, now=1.0)
    req.take(4)  # positions 6..9 computed; 10..15 still pending
    cache.take_swap_plan()
    cache.suspend(req, conv, now=2.0)
    assert conv.kv_end == 10 and tiers(cache, "A") == ["cpu", "cpu", "cpu"]
    assert len(cache.take_swap_plan().swap_out_first) == 3
    cache.check_integrity()
    cache.abort_turn(req, conv, now=3.0)  # the turn is dropped: back to the old history
    assert conv.token_ids == before and conv.kv_end == 7 and len(conv.chunks) == 2
    cache.check_integrity()


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="cache_policy"):
        get_policy("fifo")
    assert Tier("gpu") is Tier.GPU
