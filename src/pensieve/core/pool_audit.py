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
        check_gpu(blocks, dict(holders), dict(running))
    elif blocks is not None:
        check_cpu(blocks, holders, reclaim)
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


def check_gpu(blocks: BlockMap, holders: dict[int, int], running_holders: dict[int, int]) -> None:
    """Raise AssertionError unless the GPU slots agree with ``holders`` (GPU block ->
    chunks holding it) and ``running_holders`` (-> running conversations holding it)."""
    check_records(blocks)
    live = [r for r in blocks.by_hash.values() if blocks.gpu_of[r] >= 0]
    assert len(live) == blocks.num_gpu, "GPU record count"
    assert sum(1 for r in blocks.at_gpu if r >= 0) == blocks.num_gpu, "GPU slot count"
    assert blocks.gpu_refs == sum(blocks.refs_gpu[r] for r in live), "GPU refs total"
    assert blocks.shared_gpu == {blocks.gpu_of[r] for r in live if blocks.refs_gpu[r] > 1}, (
        "shared GPU")
    for b, n in holders.items():
        assert n == (blocks.gpu_refs_of(b) or 1), f"GPU block {b}: {n} holders"
    for r in live:
        b = blocks.gpu_of[r]
        assert b in holders, f"registered GPU block {b} held by no chunk"
        assert blocks.pins[r] == running_holders.get(b, 0), f"GPU block {b}: pins"
    assert blocks.num_pinned == sum(1 for r in live if blocks.pins[r]), "pinned count"

def check_cpu(blocks: BlockMap, holders: Counter[int], reclaim: list[int]) -> None:
    """Raise AssertionError unless the CPU slots agree with ``holders`` (CPU block ->
    chunks holding it) and ``reclaim`` (the CPU blocks swap-ins read, pending)."""
    live = [r for r in blocks.by_hash.values() if blocks.cpu_of[r] >= 0]
    assert len(live) == blocks.num_cpu, "CPU record count"
    assert sum(1 for r in blocks.at_cpu if r >= 0) == blocks.num_cpu, "CPU slot count"
    assert blocks.cpu_refs == sum(blocks.refs_cpu[r] for r in live), "CPU refs total"
    assert blocks.shared_cpu == {blocks.cpu_of[r] for r in live if blocks.refs_cpu[r] > 1}, (
        "shared CPU")
    for b, n in holders.items():
        assert n == (blocks.cpu_refs_of(b) or 1), f"CPU block {b}: {n} holders"
    for r in live:
        assert blocks.cpu_of[r] in holders, f"registered CPU block {blocks.cpu_of[r]} unheld"
    pending = Counter(reclaim)
    reads = 0
    for b, n in pending.items():
        r = blocks.at_cpu[b]
        if r >= 0 and blocks.reads[r]:
            assert blocks.reads[r] == n, f"CPU block {b}: reads {blocks.reads[r]}, reclaims {n}"
            reads += n
        elif b in blocks.orphans:
            assert blocks.orphans[b] == n and b not in holders, f"orphan {b}"
            reads += n
        else:
            assert n == 1 and b not in holders, f"CPU block {b} reclaim clash"
    assert reads == blocks.num_reads, f"pending reads {blocks.num_reads} != {reads}"
    assert all(b in pending for b in blocks.orphans), "an orphan with no reclaim"

def check_records(blocks: BlockMap) -> None:
    assert len(blocks.by_hash) + len(blocks.free_ids) == len(blocks.hash_of), "record rows"
    for h, r in blocks.by_hash.items():
        g, c = blocks.gpu_of[r], blocks.cpu_of[r]
        assert blocks.hash_of[r] == h and (g >= 0 or c >= 0), f"record {h.hex()}"
        assert g < 0 or blocks.at_gpu[g] == r, f"record {h.hex()}: GPU slot"
        assert c < 0 or blocks.at_cpu[c] == r, f"record {h.hex()}: CPU slot"
        assert c >= 0 or not blocks.reads[r], f"record {h.hex()}: reads, no CPU slot"
        assert g >= 0 or not (blocks.refs_gpu[r] or blocks.pins[r]), f"record {h.hex()}"
    for r in blocks.free_ids:
        assert not blocks.hash_of[r] and blocks.gpu_of[r] < 0 and blocks.cpu_of[r] < 0, r
