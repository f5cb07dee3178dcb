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
    slots = None if blocks is None else blocks.gpu if gpu else blocks.cpu
    refs_of = slots.refs_of if slots is not None else None
    owners: dict[int, str] = {}
    holders: Counter[int] = Counter()  # block -> chunks holding it
    running: Counter[int] = Counter()  # GPU block -> running conversations holding it
    for conv in conversations:
        if blocks is not None and gpu and not conv.running and conv.kv_end % chunk_size:
            last = conv.chunks[-1]  # partial: the next turn writes into it
            assert last.tier is not Tier.GPU or not blocks.gpu.refs_of(last.block), (
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
    chunks holding it) and their pins with ``running_holders`` (-> running conversations
    holding it)."""
    check_records(blocks)
    gpu = blocks.gpu
    for r in gpu.check(blocks.by_hash, holders):
        b = gpu.slot_of[r]
        assert gpu.pins[r] == running_holders.get(b, 0), f"GPU block {b}: pins"


def check_cpu(blocks: BlockMap, holders: Counter[int], reclaim: list[int]) -> None:
    """Raise AssertionError unless the CPU slots agree with ``holders`` (CPU block ->
    chunks holding it) and their pins (reads) with ``reclaim`` (the CPU blocks swap-ins
    read, pending)."""
    cpu = blocks.cpu
    cpu.check(blocks.by_hash, holders)
    pending = Counter(reclaim)
    reads = 0
    for b, n in pending.items():
        r = cpu.at[b]
        if r >= 0 and cpu.pins[r]:
            assert cpu.pins[r] == n, f"CPU block {b}: reads {cpu.pins[r]}, reclaims {n}"
            reads += n
        elif b in blocks.orphans:
            assert blocks.orphans[b] == n and b not in holders, f"orphan {b}"
            reads += n
        else:
            assert n == 1 and b not in holders, f"CPU block {b} reclaim clash"
    assert reads == blocks.num_reads, f"pending reads {blocks.num_reads} != {reads}"
    assert all(b in pending for b in blocks.orphans), "an orphan with no reclaim"


def check_records(blocks: BlockMap) -> None:
    gpu, cpu = blocks.gpu, blocks.cpu
    assert len(blocks.by_hash) + len(blocks.free_ids) == len(blocks.hash_of), "record rows"
    assert len(gpu.slot_of) == len(cpu.slot_of) == len(blocks.hash_of), "record columns"
    for h, r in blocks.by_hash.items():
        g, c = gpu.slot_of[r], cpu.slot_of[r]
        assert blocks.hash_of[r] == h and (g >= 0 or c >= 0), f"record {h.hex()}"
        assert g < 0 or gpu.at[g] == r, f"record {h.hex()}: GPU slot"
        assert c < 0 or cpu.at[c] == r, f"record {h.hex()}: CPU slot"
        assert c >= 0 or not cpu.pins[r], f"record {h.hex()}: reads, no CPU slot"
        assert g >= 0 or not (gpu.refs[r] or gpu.pins[r]), f"record {h.hex()}"
    for r in blocks.free_ids:
        assert not blocks.hash_of[r] and gpu.slot_of[r] < 0 and cpu.slot_of[r] < 0, r
