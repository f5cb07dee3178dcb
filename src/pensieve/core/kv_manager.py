"""KV block bookkeeping: which blocks hold which positions of which sequence.

A *sequence* (today a request; with the stateful cache, a conversation) owns a block table:
``table[i]`` holds positions ``[i * chunk_size, (i + 1) * chunk_size)``. Tables only grow
until the sequence is freed. Invariant (checked by :meth:`check_integrity`): every block is
free in the pool or in exactly one table, never both.
"""

from __future__ import annotations

from pensieve.core.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps sequence ids to block tables over one :class:`BlockPool`."""

    def __init__(self, num_blocks: int, chunk_size: int, watermark: float = 0.01) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.pool = BlockPool(num_blocks)
        self.chunk_size = chunk_size
        self.watermark_blocks = int(watermark * num_blocks)
        """Blocks kept free when admitting new sequences, so running ones can keep decoding."""
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    def num_new_blocks(self, seq_id: str, num_tokens: int) -> int:
        """Blocks to add so the sequence's table covers positions ``[0, num_tokens)``."""
        return max(0, cdiv(num_tokens, self.chunk_size) - len(self.block_table(seq_id)))

    def can_admit(self, seq_id: str, num_tokens: int) -> bool:
        """Room for a *new* sequence of ``num_tokens`` while keeping the watermark free."""
        need = self.num_new_blocks(seq_id, num_tokens)
        return self.pool.num_free_blocks - need >= self.watermark_blocks

    def allocate(self, seq_id: str, num_tokens: int) -> bool:
        """Grow the table to cover ``num_tokens`` positions; False (nothing taken) if no room."""
        need = self.num_new_blocks(seq_id, num_tokens)
        if need > self.pool.num_free_blocks:
            return False
        if need:
            self._tables.setdefault(seq_id, []).extend(self.pool.allocate(need))
        return True

    def free(self, seq_id: str) -> None:
        """Return all of the sequence's blocks to the pool."""
        blocks = self._tables.pop(seq_id, None)
        if blocks:
            self.pool.free(blocks)

    def check_integrity(self) -> None:
        """Assert each block is free or owned by exactly one table."""
        owner: dict[int, str] = {}
        for seq_id, table in self._tables.items():
            for b in table:
                if b in owner:
                    raise AssertionError(f"block {b} owned by {owner[b]} and {seq_id}")
                if self.pool.is_free(b):
                    raise AssertionError(f"block {b} of {seq_id} is also free")
                owner[b] = seq_id
        if len(owner) + self.pool.num_free_blocks != self.pool.num_blocks:
            raise AssertionError(
                f"{len(owner)} owned + {self.pool.num_free_blocks} free != {self.pool.num_blocks}"
            )
