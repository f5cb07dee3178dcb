"""Audit of one tier's block pool against the chunks that hold its blocks (tests and
``TieredKVCache.check``; pure Python, cost in proportion to everything held)."""

from __future__ import annotations

from collections.abc import Iterable

from pensieve.core.block_pool import BlockPool
from pensieve.core.conversation import Conversation, Tier
from pensieve.core.cpu_share import TierPoolsView, check_cpu
from pensieve.core.prefix_share import PrefixShare


def check_pools(pools: TierPoolsView, gpu_reclaim: list[int]) -> None:
    """Raise AssertionError if a block of either pool is free and held, held twice (unless
    shared), or neither (waiting to be reclaimed counts as held: ``gpu_reclaim``, and the CPU
    blocks swap-ins read), or the pending background swap-outs are off."""
    cpu_reclaim = pools.reads.now + pools.reads.ahead
    pending = list(pools.plan.swap_out.values())
    assert pools.pending_reclaim_gpu() == len(gpu_reclaim) + len(pending), "reclaim count"
    convs, c = pools.index.conversations.values(), pools.chunk_size
    check_pool(pools.gpu, Tier.GPU, gpu_reclaim + pending, convs, c, pools.share)
    if pools.cpu_share is not None:
        check_cpu(pools, cpu_reclaim)
    elif pools.cpu is not None:
        check_pool(pools.cpu, Tier.CPU, cpu_reclaim, convs, c, None)


def check_pool(pool: BlockPool, tier: Tier, reclaim: list[int],
               conversations: Iterable[Conversation], chunk_size: int,
               share: PrefixShare | None) -> None:
    """Raise AssertionError if a block of ``pool`` (of ``tier``) is free and held by a chunk
    of ``conversations``, held twice (unless ``share`` registers it), or neither (``reclaim``:
    blocks waiting to be reclaimed, held too); and check ``share`` against the holders."""
    owners: dict[int, str] = {}
    holders: dict[int, int] = {}  # GPU block -> chunks holding it
    running: dict[int, int] = {}  # GPU block -> running conversations holding it
    for conv in conversations:
        if share is not None and not conv.running and conv.kv_end % chunk_size:
            last = conv.chunks[-1]  # partial: the next turn writes into it
            assert last.tier is not Tier.GPU or not share.refs[last.block], (
                f"{conv.conversation_id}: a partial chunk holds a shareable block")
        for ch in conv.chunks:
            if ch.tier is tier:
                b = ch.block
                assert not pool.is_free(b), f"{tier} block {b} held and free"
                if share is not None:
                    holders[b] = holders.get(b, 0) + 1
                    if conv.running:
                        running[b] = running.get(b, 0) + 1
                    if b in owners:
                        assert share.refs[b], f"{tier} block {b} held twice, unshared"
                        continue
                assert b not in owners, f"{tier} block {b} held twice"
                owners[b] = conv.conversation_id
    if share is not None:
        share.check(holders, running)
    for b in reclaim:
        assert b not in owners and not pool.is_free(b), f"{tier} block {b} reclaim clash"
        owners[b] = "<reclaim>"
    total = len(owners) + pool.num_free_blocks
    assert total == pool.num_blocks, f"{tier}: {total} accounted of {pool.num_blocks}"
