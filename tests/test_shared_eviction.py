"""Eviction with shared GPU blocks (``core.shared_eviction`` and the index's candidates): a block
several conversations hold goes after every chunk held alone, whatever its sharers' own keys;
a block a running turn reads never goes; the fallback frees shared blocks when nothing else is
left, and the reference counts stay exact throughout."""

from __future__ import annotations

import pytest

from pensieve.core.conversation import Tier
from pensieve.core.request import Request
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.shared_eviction import evict_shared, shared_holders
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
               if ch.tier is Tier.GPU and not share.gpu_refs_of(ch.block)
               or ch.tier is Tier.GPU and share.gpu_refs_of(ch.block) == 1)


@pytest.mark.parametrize("policy", POLICIES)
def test_shared_blocks_go_after_every_chunk_held_alone(policy: str) -> None:
    cache = three_sharers(policy)
    share = cache.blocks
    assert share is not None
    a = cache.conversations["a"]
    shared = [ch.block for ch in a.chunks[:2]]
    assert [share.gpu_refs_of(b) for b in shared] == [3, 3]
    alone = private_gpu_chunks(cache)
    if policy in ("pensieve", "gpu-only", "return"):
        # each sharer's own key ranks its leading (shared) chunks below its other chunks
        idx = cache.index
        idx.refresh(10.0)
        for conv in cache.conversations.values():
            assert idx.key_now(conv, 0) < idx.key_now(conv, len(conv.chunks) - 1)
    freed = cache.store.evict_gpu(alone, 10.0, urgent=True)
    cache.check_integrity()
    assert freed == alone
    assert private_gpu_chunks(cache) == 0
    for conv in cache.conversations.values():  # every sharer still holds the shared blocks
        assert [ch.tier for ch in conv.chunks[:2]] == [Tier.GPU, Tier.GPU]
        assert [ch.block for ch in conv.chunks[:2]] == shared
    assert [share.gpu_refs_of(b) for b in shared] == [3, 3] and share.gpu_refs == 6
    # nothing held alone is left: the fallback frees one shared block, all sharers let it go
    assert cache.store.evict_gpu(1, 11.0, urgent=True) == 1
    cache.check_integrity()
    gone = [b for b in shared if not share.gpu_refs_of(b)]
    assert len(gone) == 1
    i = shared.index(gone[0])
    tiers = sorted(conv.chunks[i].tier.value for conv in cache.conversations.values())
    if cache.store.cpu is not None:  # the block moved once, to one CPU block all three hold
        assert tiers == ["cpu", "cpu", "cpu"]
        cpu_share = cache.blocks
        assert cpu_share is not None
        held = {conv.chunks[i].block for conv in cache.conversations.values()}
        assert len(held) == 1 and cpu_share.cpu_refs_of(held.pop()) == 3
    else:
        assert tiers == ["dropped"] * 3
    assert cache.gpu.is_free(gone[0])
    assert share.gpu_refs == 3


def test_a_chunk_shared_after_it_was_indexed_is_passed_over() -> None:
    cache = make("pensieve", gpu=24, cpu=16)
    run_turn(cache, "a", SYSTEM + [20, 21, 22, 23, 24, 25], 0.0)
    a = cache.conversations["a"]
    assert cache.index.gpu.live[a][0] == 0  # a's candidate: its leading chunk, held alone
    run_turn(cache, "b", SYSTEM + [30, 31], 1.0)  # b takes a's first two chunks
    share = cache.blocks
    assert share is not None and share.gpu_refs_of(a.chunks[0].block) == 2
    assert cache.index.gpu.live[a][0] == 0  # a's entry is not touched by b's turn
    cache.store.evict_gpu(1, 5.0, urgent=True)
    cache.check_integrity()
    assert [ch.tier for ch in a.chunks[:2]] == [Tier.GPU, Tier.GPU]
    assert share.gpu_refs_of(a.chunks[0].block) == 2
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
    assert [share.gpu_refs_of(b) for b in table[:2]] == [2, 2]
    # r holds them: none the fallback may take
    assert not shared_holders(cache.conversations, share)
    assert evict_shared(cache.index, share, 10, lambda c, i, k: None) == 0
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
    assert [share.gpu_refs_of(ch.block) for ch in a.chunks[:2]] == [1, 1]
    assert a not in cache.index.gpu.live
    assert cache.store.evictable_gpu_blocks() == 2
    assert cache.store.evict_gpu(2, 11.0, urgent=True) == 2
    cache.check_integrity()
    assert [ch.tier for ch in a.chunks] == [Tier.DROPPED] * len(a.chunks)
    assert share.num_gpu == 0 and share.gpu_refs == 0
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
    assert cache.gpu.num_free_blocks == 6 and share.num_gpu == 2
    conv = cache.conversation("n")
    req = Request("n1", list(range(100, 128)), SamplingParams(max_tokens=1),
                  conversation_id="n")  # 28 tokens: 7 blocks, no prefix in common
    req.pending = cache.pending_for(req, conv)
    assert cache.admit(req, conv, req.num_tokens, 3.0)
    cache.check_integrity()
    assert cache.gpu.num_free_blocks == 0
    assert share.num_gpu == 1  # one shared block went (both sharers let it go), one stayed
