"""TierSlots, one tier's side of the block map: the same verbs on the GPU and the CPU tier."""

from __future__ import annotations

from collections import Counter

import pytest

from pensieve.core.block_map import BlockMap
from pensieve.core.conversation import Tier
from pensieve.core.tier_slots import TierSlots


@pytest.mark.parametrize("tier", [Tier.GPU, Tier.CPU])
def test_verbs_on_either_tier(tier: Tier) -> None:
    by_hash: dict[bytes, int] = {b"a": 0, b"b": 1}
    slots = TierSlots(tier, 4, by_hash)
    slots.grow()
    slots.grow()
    assert slots.lookup(b"a") == -1 and slots.lookup(b"zz") == -1
    slots.store(2, 0)
    slots.store(3, 1)
    assert slots.lookup(b"a") == 2 and slots.refs_of(2) == 1 and slots.refs_of(0) == 0
    slots.ref(0)
    assert slots.shared == {2} and slots.num == 2 and slots.num_refs == 3
    assert slots.pin([2, 3]) == 0 and slots.pin([2]) == 1 and slots.num_pinned == 2
    assert slots.is_pinned(2) and not slots.is_pinned(1)
    assert slots.unpin([2, 3]) == 1 and slots.num_pinned == 1  # slot 2 keeps one pin
    slots.check(by_hash, Counter({2: 2, 3: 1}))
    assert slots.unref(0) == 2 and slots.shared == set() and slots.lookup(b"a") == 2
    assert slots.clear_pins(0) == 1 and slots.num_pinned == 0
    assert slots.unref(0) == 1 and slots.lookup(b"a") == -1 and slots.at[2] == -1
    assert slots.num == 1 and slots.num_refs == 1
    slots.check({b"b": 1}, Counter({3: 1}))
    with pytest.raises(AssertionError, match="holders"):
        slots.check({b"b": 1}, Counter({3: 2}))


def test_block_map_moves_a_record_between_tiers_and_forgets_it_with_its_last_slot() -> None:
    blocks = BlockMap(4, 4, 32)
    blocks.register_cpu(1, b"h")
    r = blocks.by_hash[b"h"]
    assert blocks.cpu.lookup(b"h") == 1 and blocks.gpu.lookup(b"h") == -1
    blocks.read_cpu(1)  # the last holder's read, no other pending: a private block now
    assert b"h" not in blocks.by_hash and blocks.hash_of[r] == b"" and blocks.free_ids == [r]
    blocks.register_cpu(2, b"h")  # the free row is reused
    blocks.ref_cpu(2)
    blocks.read_cpu(2)  # one holder left, one read pending
    assert blocks.cpu.pins[r] == 1 and blocks.num_reads == 1 and blocks.cpu.num_pinned == 1
    assert blocks.release_cpu(2) is False  # the read still pending: an orphan
    assert blocks.orphans == {2: 1} and blocks.cpu.num_pinned == 0 and not blocks.by_hash
