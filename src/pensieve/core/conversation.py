"""A conversation: its raw token history and where each chunk of its KV lives.

Chunk ``i`` holds the KV of positions ``[i * C, (i + 1) * C)`` (``C = chunk_size``) and is in
exactly one tier: on the GPU (a GPU block id), on the CPU (a CPU block id) or dropped (to be
recomputed from ``token_ids``). Positions ``[0, kv_end)`` have KV in their chunk unless the chunk
is dropped; ``len(chunks) == cdiv(kv_end, C)`` while the conversation is idle::

    position   0 ........ 32 ....... 64 ....... 96 ...... kv_end ... len(token_ids)
    chunk      [dropped   ][cpu       ][gpu      ][gpu    )  no KV yet (last output)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Tier(enum.Enum):
    """Where a chunk's KV is, in the retention order GPU -> CPU -> DISK -> DROPPED. A chunk
    on disk has no block: the disk index holds its file for the conversation
    (:mod:`pensieve.core.disk_index`); a dropped one has no copy anywhere."""

    GPU = "gpu"
    CPU = "cpu"
    DISK = "disk"
    DROPPED = "dropped"


@dataclass(slots=True)
class Chunk:
    """One chunk of a conversation's KV: its tier and its block id in that tier (-1: none).
    Slotted: a cache holds hundreds of thousands of them (less memory, cheaper GC passes)."""

    tier: Tier
    block: int = -1


@dataclass(eq=False)
class Conversation:
    """State kept across turns; owned by the tiered cache."""

    conversation_id: str
    token_ids: list[int] = field(default_factory=list)
    """Raw history: every input and output of the turns completed so far."""
    chunks: list[Chunk] = field(default_factory=list)
    kv_end: int = 0
    """Positions below this have KV (in a GPU or CPU chunk) or sit in a dropped chunk."""
    last_active: float = 0.0
    """When the last turn finished (or the conversation was created)."""
    running: bool = False
    """A turn is in flight: its chunks are pinned on the GPU and never evicted."""
    ephemeral: bool = False
    """A one-off request: its KV and history are freed when its turn ends."""
    priority: float = 1.0
    """Retention weight from the client (higher: kept longer)."""
    keep_alive_s: float = 0.0
    """Seconds after the last turn during which the conversation counts as not idle."""
    hints: tuple[float, float] = (1.0, 0.0)
    """(priority, keep_alive_s) as the client asked; ``priority`` and ``keep_alive_s`` are
    what the policy reads (lower while the tenant is over its share: ``core.tenant_share``)."""
    tenant: str = ""
    """Whose conversation it is (for ``tenant_kv_share``; empty: nobody's in particular)."""
    queued_at: float | None = None
    """Arrival time of a turn of it waiting in the scheduler's queue (None: none waits): its KV
    is what the next admissions need."""
    share_salt: bytes = b""
    """The salt :attr:`share_hashes` were computed with (``core.prefix_share``)."""
    share_hashes: list[bytes] = field(default_factory=list)
    """Chained hashes of the history's full chunks as far as computed (shared prefixes)."""
    share_upto: int = 0
    """Chunks below this were offered for registration when a turn ended (shared prefixes)."""
    share_back: list[int] = field(default_factory=list)
    """Chunks below :attr:`share_upto` that admissions brought back to the GPU since (swapped
    in or recomputed: private blocks again), to offer when the turn ends."""
    pinned_shared: list[int] = field(default_factory=list)
    """While running: its registered GPU blocks (shared prefixes), each pinned once by it;
    the rest of its block table is private. Empty while idle."""
    block_table: tuple[int, ...] = ()
    """While running: the GPU block of each chunk, replaced by a longer tuple as chunks are
    added (never changed in place, so each step's output holds it without a copy). Empty while
    idle."""

    def chunk_tokens(self, index: int, chunk_size: int) -> int:
        """Positions of chunk ``index`` that hold (or held) KV."""
        return max(0, min(chunk_size, self.kv_end - index * chunk_size))

    def dropped_chunks(self, tiers: list[Tier] | None = None) -> list[int]:
        """Indices of the chunks in no block (dropped, or on disk: a turn reads them back or
        recomputes them; ascending; one pass at C speed when there are none, the common
        case). ``tiers``: each chunk's tier, if the caller has them."""
        if tiers is None:
            tiers = [ch.tier for ch in self.chunks]
        if Tier.DROPPED not in tiers and Tier.DISK not in tiers:
            return []
        return [i for i, t in enumerate(tiers) if t is Tier.DROPPED or t is Tier.DISK]
