"""One tier's side of the block map (:mod:`pensieve.core.block_map`): which slot of the tier
each registered block has, and each slot's references and pins.

The GPU and the CPU tier each have one :class:`TierSlots`, with the same columns and verbs;
only what a pin means differs:

- GPU: a pin is a running conversation that holds the slot (its turn reads the block);
- CPU: a pin is a planned swap-in that still reads the slot (freed once read).

A record is a row id shared by both tiers' columns (the block map hands them out); a slot is a
block id of the tier's pool. Pure bookkeeping: the store allocates and frees the blocks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from pensieve.core.conversation import Tier


class TierSlots:
    """One tier's columns of the block map's records (module docstring)."""

    __slots__ = ("tier", "by_hash", "slot_of", "at", "refs", "pins", "shared", "num",
                 "num_refs", "num_pinned")

    def __init__(self, tier: Tier, num_blocks: int, by_hash: dict[bytes, int]) -> None:
        self.tier = tier
        self.by_hash = by_hash
        """The block map's hash -> record id (shared by both tiers)."""
        self.slot_of: list[int] = []
        """Each record's slot in this tier (-1: none)."""
        self.at: list[int] = [-1] * num_blocks
        """Slot -> its record's id (-1: private or free)."""
        self.refs: list[int] = []
        """Chunks holding each record's slot."""
        self.pins: list[int] = []
        """Each record's pins (GPU: running conversations holding its slot; CPU: planned
        swap-ins reading it, not reclaimed yet)."""
        self.shared: set[int] = set()
        """Slots two or more chunks hold (no eviction candidates alone)."""
        self.num = 0
        """Records with a slot in this tier."""
        self.num_refs = 0
        """Chunks holding a registered slot of this tier."""
        self.num_pinned = 0
        """Records whose slot has a pin."""

    def grow(self) -> None:
        """One more record row (no slot)."""
        self.slot_of.append(-1)
        self.refs.append(0)
        self.pins.append(0)

    # ------------------------------------------------------------------ the verbs
    def lookup(self, h: bytes) -> int:
        """The slot of hash ``h`` in this tier, or -1."""
        r = self.by_hash.get(h)
        return -1 if r is None else self.slot_of[r]

    def refs_of(self, slot: int) -> int:
        """Chunks holding ``slot`` if registered (0: unregistered)."""
        r = self.at[slot]
        return 0 if r < 0 else self.refs[r]

    def is_pinned(self, slot: int) -> bool:
        """The registered ``slot`` has a pin."""
        r = self.at[slot]
        return r >= 0 and self.pins[r] > 0

    def store(self, slot: int, r: int) -> None:
        """Record ``r`` (no slot in this tier) takes ``slot``, held by one chunk."""
        self.slot_of[r], self.refs[r] = slot, 1
        self.at[slot] = r
        self.num += 1
        self.num_refs += 1

    def ref(self, r: int) -> None:
        """One more chunk holds record ``r``'s slot."""
        n = self.refs[r] = self.refs[r] + 1
        self.num_refs += 1
        if n == 2:
            self.shared.add(self.slot_of[r])

    def unref(self, r: int) -> int:
        """One chunk lets record ``r``'s slot go; returns its references before. The last one
        unregisters the slot (the caller frees or keeps the block, and settles its pins)."""
        slot, n = self.slot_of[r], self.refs[r]
        self.refs[r] = n - 1
        self.num_refs -= 1
        if n == 2:
            self.shared.discard(slot)
        elif n == 1:
            self.at[slot] = -1
            self.slot_of[r] = -1
            self.num -= 1
        return n

    def pin(self, slots: Sequence[int]) -> int:
        """One pin more on each of these registered ``slots``; returns how many had one."""
        at, pins, already = self.at, self.pins, 0
        for b in slots:
            r = at[b]
            if pins[r]:
                already += 1
            else:
                self.num_pinned += 1
            pins[r] += 1
        return already

    def unpin(self, slots: Sequence[int]) -> int:
        """One pin less on each of these ``slots`` (an unregistered one has none); returns how
        many have none left."""
        at, pins, unpinned = self.at, self.pins, 0
        for b in slots:
            r = at[b]
            if r < 0 or not pins[r]:
                unpinned += 1
            elif pins[r] > 1:
                pins[r] -= 1
            else:
                pins[r] = 0
                self.num_pinned -= 1
                unpinned += 1
        return unpinned

    def pin_record(self, r: int) -> None:
        """One pin more on record ``r``'s slot."""
        if not self.pins[r]:
            self.num_pinned += 1
        self.pins[r] += 1

    def unpin_record(self, r: int) -> None:
        """One pin less on record ``r``'s slot (it has one)."""
        n = self.pins[r] = self.pins[r] - 1
        if not n:
            self.num_pinned -= 1

    def clear_pins(self, r: int) -> int:
        """Record ``r``'s slot loses every pin (it leaves the tier); returns how many."""
        n = self.pins[r]
        if n:
            self.pins[r] = 0
            self.num_pinned -= 1
        return n

    # ------------------------------------------------------------------ audit
    def check(self, live_ids: Mapping[bytes, int],
              holders: Counter[int] | dict[int, int]) -> list[int]:
        """Assert this tier's columns agree with ``live_ids`` (the block map's records) and
        ``holders`` (slot -> chunks holding it); returns the records with a slot here."""
        t = self.tier.value.upper()
        live = [r for r in live_ids.values() if self.slot_of[r] >= 0]
        assert len(live) == self.num, f"{t} record count"
        assert sum(1 for r in self.at if r >= 0) == self.num, f"{t} slot count"
        assert self.num_refs == sum(self.refs[r] for r in live), f"{t} refs total"
        assert self.shared == {self.slot_of[r] for r in live if self.refs[r] > 1}, f"shared {t}"
        for b, n in holders.items():
            assert n == (self.refs_of(b) or 1), f"{t} block {b}: {n} holders"
        for r in live:
            assert self.slot_of[r] in holders, f"registered {t} block {self.slot_of[r]} unheld"
        assert self.num_pinned == sum(1 for r in live if self.pins[r]), f"{t} pinned count"
        return live
