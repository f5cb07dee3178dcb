"""Writing the CPU tier's next spills to disk ahead of them (pure Python).

With a disk tier, a chunk that the retention order drops from a full CPU tier is spilled:
its bytes are copied out of its CPU block before the step's copies reuse that block
(``DiskPlan.writes``). Those copies are on the step path, and they come in bursts: a turn that
comes back after a long idle swaps in and restores a few hundred chunks in one step, and as
many leave the CPU tier in that step to make room. On an H100 host such a step spent 60 ms
copying spills out (docs/benchmarks.md, "The disk tier on an H100 (long idle)").

So, in a step that spilled chunks (or after a walk that stopped at :data:`WRITE_AHEAD_PER_STEP`
or passed over chunks still being copied into the CPU tier),
:func:`write_ahead` plans the write of the full chunks next in the CPU tier's retention order
that have no file yet (``DiskPlan.ahead``), up to :data:`WRITE_AHEAD_SHARE` of the tier: each
chunk stays in its CPU block, so the engine copies its bytes beside the step's compute and
waits for those copies only before the next step's plan is carried out. When the order later
drops such a chunk, its spill finds the file and only holds it: no copy on the step path.

A chunk written ahead and then swapped in instead (its conversation came back first) leaves
its file on disk, held by no one and first in the disk's order, as the copies a conversation
lets go of at admission (``DiskIndex.let_go_ahead``): while it lasts, the same file serves
the chunk's next spill, or a turn with the same prefix, or a restart.

Shared CPU blocks, partial chunks (by their KV: a turn's last token has none yet, though its
chunk's tokens are all in the history), chunks without the turn's salt and blocks that this
step's swap-outs copy into are not written ahead (their spills are as before).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pensieve.core.conversation import Tier
from pensieve.core.disk_index import DiskEntry, shared_name, spilled_key

if TYPE_CHECKING:
    from pensieve.core.kv_store import KVStore

WRITE_AHEAD_SHARE = 8
"""The lowest ``num_cpu_blocks // WRITE_AHEAD_SHARE`` chunks of the CPU tier (at least one, in
its retention order) are kept written to disk ahead of their spill."""

WRITE_AHEAD_PER_STEP = 64
"""At most this many chunks are written ahead in one step (their copies run beside that step's
compute: a few milliseconds of host copies)."""


def write_ahead(store: KVStore, now: float, due: bool) -> bool:
    """Plan the writes of the CPU tier's next spills (module docstring) into the disk index's
    plan, if the step's plan spills chunks or ``due`` (the last call returned True: it stopped
    at its cap or passed over chunks still being copied in); returns whether the next step
    should walk again though it spills nothing. Changes no chunk, block or eviction index:
    only disk entries (each added as a spill would add it, an entry of lower key evicted to
    make room)."""
    disk, cpu, index = store.disk, store.cpu, store.index
    if disk is None or cpu is None or disk.capacity == 0:
        return False
    if not (disk.plan.writes or due):
        return False
    target = max(1, cpu.num_blocks // WRITE_AHEAD_SHARE)
    c = store.chunk_size
    plan = store.plan
    busy = plan.swap_out.keys() | plan.swap_out_first.keys()  # bytes still to come
    shared = index.shared_cpu
    key_of, cost, step = index.policy.key, index.cost, index.step
    seen = planned = 0
    more = False
    for _, conv, first in index.cpu.lowest():
        cid = conv.conversation_id
        salt = disk.salts.get(cid)
        hashes = disk.hashes_of(cid, conv.token_ids, salt) if salt is not None else []
        chunks = conv.chunks
        for i in (range(first, len(chunks)) if step > 0 else range(first, -1, -1)):
            ch = chunks[i]
            if ch.tier is not Tier.CPU or ch.block in shared:
                continue
            seen += 1
            if ch.block in busy:
                more = True  # its bytes land in this step: at the next
            elif i < len(hashes) and conv.chunk_tokens(i, c) == c:  # KV of every slot
                h = hashes[i].hex()
                if shared_name(h) not in disk.files:
                    entry = DiskEntry("", i, c, h, spilled_key(key_of(conv, i, now, cost, c)))
                    if not disk.store_ahead(cid, entry, ch.block):
                        return more  # the disk keeps higher keys than this chunk's
                    planned += 1
                    if planned >= WRITE_AHEAD_PER_STEP:
                        return True
            if seen >= target:
                return more
    return more
