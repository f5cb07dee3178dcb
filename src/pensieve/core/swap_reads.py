"""The CPU blocks that planned swap-ins read, and when they are freed (pure Python).

A CPU block whose chunk was swapped in stays taken until the runner has read it: a swap-out
planned in the same step must not overwrite it first. Those of this and the previous step's
swap-ins are freed at the next step's start; those of this step's ``swap_in_ahead`` one step
later. A registered (shared) CPU block is freed only once no chunk holds it and its reads are
done (:meth:`~pensieve.core.block_map.BlockMap.end_reads`)."""

from __future__ import annotations

from collections import Counter

from pensieve.core.block_map import BlockMap
from pensieve.core.block_pool import BlockPool


class SwapInReads:
    """The CPU blocks planned swap-ins read, freed once the runner has read them: ``now``
    (this and the previous step's swap-ins: at the next step's start) and ``ahead`` (this
    step's ``swap_in_ahead``: they join ``now`` then, so are freed one step later). A
    registered CPU block is freed only once no chunk holds it and its reads are done
    (:meth:`BlockMap.end_reads`)."""

    def __init__(self, pool: BlockPool | None, blocks: BlockMap | None) -> None:
        self.pool, self.blocks = pool, blocks
        self.now: list[int] = []
        self.ahead: list[int] = []

    def begin_step(self) -> None:
        """Free the blocks of ``now``; ``ahead`` becomes ``now``."""
        if self.pool is not None:
            if self.blocks is not None:
                self.blocks.end_reads(self.pool, self.now)
            else:
                self.pool.free(self.now)
        self.now, self.ahead = self.ahead, []

    def add(self, blocks: list[int]) -> None:
        """This step's swap-ins read ``blocks`` (freed at the next step's start)."""
        self.now.extend(blocks)

    def move_ahead(self, blocks: list[int]) -> None:
        """The swap-ins reading ``blocks`` move to this step's ``swap_in_ahead``."""
        if self.blocks is None or not self.blocks.num_reads:  # each block once in ``now``
            moved = set(blocks)
            self.now = [b for b in self.now if b not in moved]
        else:  # a shared block read by several swap-ins: one entry per read, from the end
            drop = Counter(blocks)
            keep: list[int] = []
            for b in reversed(self.now):
                if drop[b]:
                    drop[b] -= 1
                else:
                    keep.append(b)
            self.now = keep[::-1]
        self.ahead.extend(blocks)
