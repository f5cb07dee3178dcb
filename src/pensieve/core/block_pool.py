"""A pool of KV blocks (one block = one chunk of ``chunk_size`` token slots, in every layer).

Invariant: every block id in ``[0, num_blocks)`` is either free (in the free heap exactly once)
or owned by exactly one caller. Allocation takes the lowest free ids (O(log n) per block), so
blocks handed out together tend to be consecutive: swaps then move long runs per copy.
"""

from __future__ import annotations

import heapq


class OutOfBlocksError(RuntimeError):
    """Raised when more blocks are requested than are free."""


class BlockPool:
    """Lowest-id-first allocator of integer block ids."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks))  # a heap (sorted is a valid heap)
        self._is_free = [True] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (lowest ids first on a fresh pool)."""
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        out = [heapq.heappop(self._free) for _ in range(n)]
        for b in out:
            self._is_free[b] = False
        return out

    def allocate_one(self) -> int:
        """Take the lowest free block (``allocate(1)[0]`` without the list)."""
        if not self._free:
            raise OutOfBlocksError("asked for 1 block, 0 free")
        b = heapq.heappop(self._free)
        self._is_free[b] = False
        return b

    def free_one(self, block: int) -> None:
        """Give one block back (``free([block])`` without the list)."""
        if self._is_free[block]:
            raise ValueError(f"block {block} freed twice")
        self._is_free[block] = True
        heapq.heappush(self._free, block)

    def free(self, blocks: list[int]) -> None:
        """Give blocks back; freeing a block that is already free is a bug and raises."""
        for b in blocks:
            if self._is_free[b]:
                raise ValueError(f"block {b} freed twice")
            self._is_free[b] = True
            heapq.heappush(self._free, b)

    def is_free(self, block: int) -> bool:
        return self._is_free[block]
