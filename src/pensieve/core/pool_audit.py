"""Audit of one tier's block pool against the chunks that hold its blocks (tests and
``TieredKVCache.check_integrity``; pure Python, cost in proportion to everything held)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from pensieve.core.block_map import BlockMap
from pensieve.core.block_pool import BlockPool
from pensieve.core.conversation import Conversation, Tier


def check_pool(pool: BlockPool, tier: Tier, reclaim: list[int],
               conversations: Iterable[Conversation], chunk_size: int,
               blocks: BlockMap | None) -> None:
    """Raise AssertionError if a block of ``pool`` (of ``tier``, GPU or CPU) is free and held
    by a chunk of ``conversations``, held twice (unless ``blocks`` registers it), or neither
    (``reclaim``: blocks waiting to be reclaimed, held too; a registered CPU block read by
    several swap-ins is listed once per read); and check ``blocks``' slots of the tier against
    the holders."""
    gpu = tier is Tier.GPU
    refs_of = (blocks.gpu_refs_of if gpu else blocks.cpu_refs_of) if blocks is not None else None
    owners: dict[int, str] = {}
    holders: Counter[int] = Counter()  # block -> chunks holding it
    running: Counter[int] = Counter()  # GPU block -> running conversations holding it
    for conv in conversations:
        if blocks is not None and gpu and not conv.running and conv.kv_end % chunk_size:
            last = conv.chunks[-1]  # partial: the next turn writes into it
            assert last.tier is not Tier.GPU or not blocks.gpu_refs_of(last.block), (
                f"{conv.conversation_id}: a partial chunk holds a shareable block")
        for ch in conv.chunks:
            if ch.tier is tier:
                b = ch.block
                assert not pool.is_free(b), f"{tier} block {b} held and free"
                holders[b] += 1
                if conv.running:
                    running[b] += 1
                if b in owners:
                    assert refs_of is not None and refs_of(b), f"{tier} block {b} held twice"
                    continue
                owners[b] = conv.conversation_id
    if blocks is not None and gpu:
        blocks.check_gpu(dict(holders), dict(running))
    elif blocks is not None:
        blocks.check_cpu(holders, reclaim)
    for b in set(reclaim):
        assert not pool.is_free(b), f"{tier} block {b} read and free"
        if b in owners:  # a registered CPU block others hold still (its reads checked above)
            assert refs_of is not None and not gpu and refs_of(b), f"{tier} block {b} clash"
            continue
        owners[b] = "<reclaim>"
    assert (blocks is not None and not gpu) or len(set(reclaim)) == len(reclaim), (
        f"{tier}: a block reclaimed twice")
    total = len(owners) + pool.num_free_blocks
    assert total == pool.num_blocks, f"{tier}: {total} accounted of {pool.num_blocks}"
