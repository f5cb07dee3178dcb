"""Eviction with shared GPU blocks (``core.shared_eviction`` and the index's candidates): a block
several conversations hold is one unit of the retention order, keyed by its sharers' keys
together (the sum of their retention values; the most recent sharer's for the LRU orders), and
leaves whole; a block a running turn reads never goes; the fallback frees shared blocks whose
sharers left, and the reference counts stay exact throughout."""

from __future__ import annotations

import pytest

from pensieve.core.conversation import Tier
from pensieve.core.eviction import EvictionKey
from pensieve.core.request import Request
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.shared_eviction import SharedOrder, lowest_shared
from pensieve.core.tiered_cache import TieredKVCache
from tests.test_prefix_share import SYSTEM, make, run_turn

POLICIES = ["pensieve", "gpu-only", "lru", "prefix-lru", "return"]


def three_sharers(policy: str, gpu: int = 24, cpu: int = 16) -> TieredKVCache:
    """a, b, c: SYSTEM's two full chunks shared (refs 3), then chunks of their own."""
    cache = make(policy, gpu=gpu, cpu=cpu)
    for t, (cid, tail) in enumerate([("a", [20, 21, 22, 23, 24, 25]), ("b", [30, 31, 32, 33]),
                                     ("c", [40, 41, 42, 43, 44])]):
        run_turn(cache, cid, SYSTEM + tail, float(t))
    return cache


def private_gpu_chunks(cache: TieredKVCache) -> int:
    share = cache.blocks
    assert share is not None
    return sum(1 for conv in cache.conversations.values() for ch in conv.chunks
               if ch.tier is Tier.GPU and not share.gpu.refs_of(ch.block)
               or ch.tier is Tier.GPU and share.gpu.refs_of(ch.block) == 1)


def units(cache: TieredKVCache, now: float) -> list[tuple[EvictionKey, tuple[object, ...]]]:
    """Every GPU eviction unit of the idle conversations with its key now, lowest first, by
    brute force: a chunk held alone (its own key), a block two chunks or more hold (the
    policy's ``combine`` of its holders' keys)."""
    idx, share = cache.index, cache.blocks
    assert share is not None
    idx.refresh(now)
    out: list[tuple[EvictionKey, tuple[object, ...]]] = []
    by_block: dict[int, list[EvictionKey]] = {}
    for conv in cache.conversations.values():
        for i, ch in enumerate(conv.chunks):
            if ch.tier is Tier.GPU and not conv.running:
                if share.gpu.refs_of(ch.block) >= 2:
                    by_block.setdefault(ch.block, []).append(idx.key_now(conv, i))
                else:
                    out.append((idx.key_now(conv, i), ("chunk", conv.conversation_id, i)))
    out += [(idx.policy.combine(ks), ("block", b)) for b, ks in by_block.items()]
    return sorted(out, key=lambda u: u[0])


def gone(cache: TieredKVCache, unit: tuple[object, ...]) -> bool:
    if unit[0] == "chunk":
        return cache.conversations[str(unit[1])].chunks[int(unit[2])].tier is not Tier.GPU
    return cache.gpu.is_free(int(unit[1]))  # type: ignore[call-overload]


@pytest.mark.parametrize("policy", ["pensieve", "gpu-only", "return", "prefix-lru"])
@pytest.mark.parametrize("now", [2.5, 10.0, 400.0])
def test_eviction_follows_one_order_of_chunks_and_whole_shared_blocks(policy: str,
                                                                       now: float) -> None:
    """An urgent pass takes, one unit at a time, the lowest of every chunk held alone and
    every shared block keyed by its sharers' combined key (the sum of their retention
    values; the most recent sharer's for prefix-lru); a shared block leaves whole."""
    cache = three_sharers(policy)
    share = cache.blocks
    assert share is not None
    shared = [ch.block for ch in cache.conversations["a"].chunks[:2]]
    assert [share.gpu.refs_of(b) for b in shared] == [3, 3]
    order = units(cache, now)
    taken = []
    while order:
        want = order[0]
        assert cache.store.evict_gpu(1, now, urgent=True) == 1
        cache.check_integrity()
        assert gone(cache, want[1]), (want, taken)
        taken.append(want[1])
        order = units(cache, now)
    assert sum(1 for u in taken if u[0] == "block") == 2
    for i, b in enumerate(shared):  # each block moved once: one CPU block all three hold
        held = {conv.chunks[i].block for conv in cache.conversations.values()}
        tiers = {conv.chunks[i].tier for conv in cache.conversations.values()}
        if cache.store.cpu is not None and tiers == {Tier.CPU}:
            assert len(held) == 1 and share.cpu.refs_of(held.pop()) == 3
        else:
            assert tiers <= {Tier.CPU, Tier.DROPPED}
        assert cache.gpu.is_free(b)
    assert share.gpu.num_refs == 0


def test_the_sum_of_sharers_keeps_a_widely_shared_block_and_lets_a_lone_pair_go() -> None:
    """Retention value: a block that many recent conversations share outranks the chunks any
    one of them holds alone, and a block two long-idle ones share goes before a recent
    conversation's own chunks."""
    cache = make("pensieve", gpu=64, cpu=32)
    for t, cid in enumerate(["old1", "old2"]):
        run_turn(cache, cid, [9] * 8 + [50 + t] * 3, float(t))  # share chunk 0 of [9] * 8
    for t, cid in enumerate(["n1", "n2", "n3", "n4", "n5", "n6"]):
        run_turn(cache, cid, SYSTEM + [60 + t] * 9, 100.0 + t)
    share = cache.blocks
    assert share is not None
    old_block = cache.conversations["old1"].chunks[0].block
    system_block = cache.conversations["n1"].chunks[0].block
    assert share.gpu.refs_of(old_block) == 2 and share.gpu.refs_of(system_block) == 6
    now = 110.0
    order = units(cache, now)
    # the long-idle pair's block comes before the recent conversations' own chunks (chunk 2
    # on), the system prompt's after all of them
    pos = {u[1]: n for n, u in enumerate(order)}
    recent = ["n1", "n2", "n3", "n4", "n5", "n6"]
    recent_own = [pos[("chunk", c, 2)] for c in recent]
    assert pos[("block", old_block)] < min(recent_own)
    assert pos[("block", system_block)] > max(recent_own)
    n = pos[("block", old_block)] + 1
    assert cache.store.evict_gpu(n, now, urgent=True) == n
    cache.check_integrity()
    assert cache.gpu.is_free(old_block)
    assert all(cache.conversations[c].chunks[0].tier is not Tier.GPU for c in ["old1", "old2"])
    assert not cache.gpu.is_free(system_block)
    assert all(cache.conversations[c].chunks[2].tier is Tier.GPU for c in recent)


def test_lru_keys_a_shared_block_by_its_most_recent_sharer() -> None:
    cache = three_sharers("lru")
    idx = cache.index
    idx.refresh(5.0)
    keys = [idx.key_now(conv, 0) for conv in cache.conversations.values()]
    assert idx.policy.combine(keys) == max(keys)
    # a and b go whole first (least recently used), the shared blocks with c, the last user
    assert cache.store.evict_gpu(1, 5.0, urgent=True) >= 1
    cache.check_integrity()
    a, c = cache.conversations["a"], cache.conversations["c"]
    assert all(ch.tier is Tier.GPU for ch in a.chunks[:2])
    assert all(ch.tier is not Tier.GPU for ch in a.chunks[2:])
    assert all(ch.tier is Tier.GPU for ch in c.chunks)


def test_a_chunk_shared_after_it_was_indexed_is_passed_over() -> None:
    cache = make("pensieve", gpu=24, cpu=16)
    run_turn(cache, "a", SYSTEM + [20, 21, 22, 23, 24, 25], 0.0)
    a = cache.conversations["a"]
    assert cache.index.gpu.live[a][0] == 0  # a's candidate: its leading chunk, held alone
    run_turn(cache, "b", SYSTEM + [30, 31], 1.0)  # b takes a's first two chunks
    share = cache.blocks
    assert share is not None and share.gpu.refs_of(a.chunks[0].block) == 2
    assert cache.index.gpu.live[a][0] == 0  # a's entry is not touched by b's turn
    cache.store.evict_gpu(1, 5.0, urgent=True)
    cache.check_integrity()
    assert [ch.tier for ch in a.chunks[:2]] == [Tier.GPU, Tier.GPU]
    assert share.gpu.refs_of(a.chunks[0].block) == 2
    # the chunk that left is one held alone (a's or b's; pensieve's order decides which)
    b = cache.conversations["b"]
    left = [ch for ch in a.chunks[2:] + b.chunks[2:] if ch.tier is not Tier.GPU]
    assert len(left) == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_a_running_turns_chunks_are_never_chosen(policy: str) -> None:
    cache = make(policy, gpu=24, cpu=4)
    run_turn(cache, "x", SYSTEM + [20, 21, 22], 0.0)
    conv = cache.conversation("r")
    req = Request("r1", SYSTEM + [30, 31, 32, 33, 34], SamplingParams(max_tokens=1),
                  conversation_id="r")
    req.pending = cache.pending_for(req, conv)
    assert cache.admit(req, conv, req.num_tokens, 1.0)
    table = conv.block_table
    share = cache.blocks
    assert share is not None and req.cache_stats.shared_hit_tokens == 8
    x = cache.conversations["x"]
    cache.store.evict_gpu(100, 2.0, urgent=True)
    cache.check_integrity()
    assert conv.block_table == table
    assert all(ch.tier is Tier.GPU for ch in conv.chunks)
    assert all(not cache.gpu.is_free(b) for b in table)
    # x's chunks that r reads stay (their block could not go), the rest of x left
    assert [ch.tier for ch in x.chunks[:2]] == [Tier.GPU, Tier.GPU]
    assert all(ch.tier is not Tier.GPU for ch in x.chunks[2:])
    assert [share.gpu.refs_of(b) for b in table[:2]] == [2, 2]
    # r holds them: none the fallback may take
    assert lowest_shared(cache.index, share, Tier.GPU) is None
    order = SharedOrder(cache.index, share, Tier.GPU)
    assert order.top() is None
    cache.check_integrity()


def test_shared_blocks_whose_sharers_left_still_go() -> None:
    cache = three_sharers("pensieve", gpu=24, cpu=0)
    share = cache.blocks
    assert share is not None
    a = cache.conversations["a"]
    cache.store.evict_gpu(private_gpu_chunks(cache), 10.0, urgent=True)
    cache.delete("b")
    cache.delete("c")
    cache.check_integrity()
    # a's shared chunks now have one reference each, and are no entry of the index yet
    assert [share.gpu.refs_of(ch.block) for ch in a.chunks[:2]] == [1, 1]
    assert a not in cache.index.gpu.live
    assert cache.store.evictable_gpu_blocks() == 2
    assert cache.store.evict_gpu(2, 11.0, urgent=True) == 2
    cache.check_integrity()
    assert [ch.tier for ch in a.chunks] == [Tier.DROPPED] * len(a.chunks)
    assert share.gpu.num == 0 and share.gpu.num_refs == 0
    assert cache.gpu.num_free_blocks == cache.gpu.num_blocks


def test_admission_makes_room_from_shared_blocks() -> None:
    """Every idle GPU block is shared: a turn that needs them is still admitted (fallback)."""
    cache = make("pensieve", gpu=8, cpu=0)
    run_turn(cache, "a", SYSTEM[:8], 0.0)  # 8 + 1 tokens: chunks 0, 1 full, 2 partial
    run_turn(cache, "b", SYSTEM[:8], 1.0)
    share = cache.blocks
    assert share is not None
    cache.store.evict_gpu(private_gpu_chunks(cache), 2.0, urgent=True)
    cache.check_integrity()
    assert cache.gpu.num_free_blocks == 6 and share.gpu.num == 2
    conv = cache.conversation("n")
    req = Request("n1", list(range(100, 128)), SamplingParams(max_tokens=1),
                  conversation_id="n")  # 28 tokens: 7 blocks, no prefix in common
    req.pending = cache.pending_for(req, conv)
    assert cache.admit(req, conv, req.num_tokens, 3.0)
    cache.check_integrity()
    assert cache.gpu.num_free_blocks == 0
    assert share.gpu.num == 1  # one shared block went (both sharers let it go), one stayed


def test_a_ranked_block_whose_holders_changed_at_that_time_is_passed_over() -> None:
    """The ranking is built once per eviction time: a block one of whose holders was deleted
    since (same time) is passed over, not taken with a stale holder list or read past the
    deleted conversation's chunks."""
    cache = three_sharers("pensieve", gpu=24, cpu=0)
    share = cache.blocks
    assert share is not None
    order = cache.store.shared_order[0]
    assert order is not None
    cache.index.refresh(10.0)
    top = order.top()
    assert top is not None and len(top[2]) == 3
    cache.delete("b")  # between two passes at the same time
    cache.check_integrity()
    cache.index.refresh(10.0)
    nxt = order.top()
    assert nxt is None or all(conv.conversation_id != "b" for _, conv, _ in nxt[2])
    assert cache.store.evict_gpu(100, 10.0, urgent=True) > 0
    cache.check_integrity()
