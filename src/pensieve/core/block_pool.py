"""A pool of KV blocks (one block = one chunk of ``chunk_size`` token slots, in every layer).

Invariant: every block id in ``[0, num_blocks)`` is either free (in the free queue exactly once)
or owned by exactly one caller. Allocation and freeing are O(1) per block.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocksError(RuntimeError):
    """Raised when more blocks are requested than are free."""


class BlockPool:
    """Free-list allocator of integer block ids."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (lowest ids first on a fresh pool)."""
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._is_free[b] = False
        return out

    def free(self, blocks: list[int]) -> None:
        """Give blocks back; freeing a block that is already free is a bug and raises."""
        for b in blocks:
            if self._is_free[b]:
                raise ValueError(f"block {b} freed twice")
            self._is_free[b] = True
            self._free.append(b)

    def is_free(self, block: int) -> bool:
        return self._is_free[block]
