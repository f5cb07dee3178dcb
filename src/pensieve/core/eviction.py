"""Eviction policies as strategies: which chunk leaves a tier first.

Every policy orders candidate chunks of *idle* conversations (running ones are pinned) by a
sortable key, lowest first. The cache evicts GPU chunks to the CPU tier (or drops them when a
policy has no CPU tier), and drops CPU chunks, in that order. Policies are chosen by name:

========== ============================================================ ========= ==========
name       order                                                        CPU tier  keeps KV
========== ============================================================ ========= ==========
pensieve   retention value ``V = Cost(context_len) / idle_time``        yes       yes
gpu-only   the same value                                               no        yes
lru        least recently used conversation, all of its chunks at once  yes       yes
prefix-lru LRU conversation, *tail* chunk first (a prefix cache)        yes       yes
return     ``Cost(context_len) * P(the conversation returns | idle)``   yes       yes
stateless  (nothing is kept after a turn)                               no        no
========== ============================================================ ========= ==========

Not offered by name (the simulator builds it): ``oracle`` (:class:`OraclePolicy`), a
clairvoyant order that is told when each idle conversation's next turn arrives.

``return`` (:class:`ReturnPolicy`) weighs the recompute a chunk saves by the chance that the
conversation has another turn coming, given how long it has been idle, for exponential think
times of mean ``think_s`` and a chance ``continue_p`` that a turn is followed by another:
``P = q e^(-t/T) / (q e^(-t/T) + 1 - q)``. Where ``1 / idle_time`` keeps a long history that
ended minutes ago above a short one that is mid-conversation, this lets the ended ones go.

``oracle`` (:class:`OraclePolicy`) is the bound the others are measured against: given each
conversation's next arrival (the load generator knows its think times), it keeps the chunks
whose ``Cost(context_len) / (next arrival - now)`` is highest, recompute saved per second of
holding (a cost-weighted Belady order), and lets conversations with no next turn go first.
Its key grows as the next turn nears, so the eviction index re-keys it at every eviction time
(``key_may_grow``) instead of keeping lower bounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pensieve.core.conversation import Conversation

EvictionKey = tuple[float, float, str, float]
"""(primary, secondary, conversation id, chunk order): compared as a tuple, lowest first."""

QUEUED_VALUE = 1e15
"""Retention value floor of conversations with a turn in the queue (far above any
``Cost / idle_time``; minus the queueing time, so the queue's tail is evicted first)."""

ChunkCost = Callable[[int], float]
"""Time to recompute one chunk whose context (last position + 1) is the argument."""


@dataclass(frozen=True)
class EvictionPolicy:
    """Base strategy: the retention value of Pensieve."""

    name: str = "pensieve"
    uses_cpu_tier: bool = True
    keeps_kv: bool = True
    whole_conversation: bool = False
    """Evict every chunk of a conversation in a tier once one of them is chosen."""
    tail_first: bool = False
    """Within a conversation, keys grow from the last chunk to the first (else first to last).
    The cache relies on this order; it holds when ``Cost`` does not decrease with context."""
    time_dependent: bool = True
    """The key depends on ``now``; it must not grow as ``now`` advances while the
    conversation stays idle (the cache's index keeps keys at a later time as lower bounds).
    False: it depends only on the conversation and the chunk."""
    key_may_grow: bool = False
    """The key may grow while the conversation stays idle (``oracle``): the eviction index
    then evaluates every candidate at each new eviction time (exact; ``O(candidates)`` per
    eviction time) instead of keeping lower bounds."""

    def key(
        self, conv: Conversation, index: int, now: float, cost: ChunkCost, chunk_size: int
    ) -> EvictionKey:
        """Lower keys are evicted first."""
        # min((index + 1) * chunk_size, max(kv_end, 1)) and the idle time
        # max(now - last_active - keep_alive_s, 1 ms), inline: the cache computes this for
        # every chunk it evicts
        end, kv_end = (index + 1) * chunk_size, conv.kv_end
        if conv.queued_at is not None:
            # A turn of it waits to be admitted: kept after every conversation that is only
            # thinking, the most recently queued (admitted last) going first. Constant while
            # queued, so it never grows with time (the index's lower bounds hold).
            return (QUEUED_VALUE - conv.queued_at, conv.last_active, conv.conversation_id,
                    float(index))
        context_len = end if end < kv_end else (kv_end if kv_end > 1 else 1)
        idle = now - conv.last_active - conv.keep_alive_s
        value = conv.priority * cost(context_len) / (idle if idle > 1e-3 else 1e-3)
        return (value, conv.last_active, conv.conversation_id, float(index))

    def combine(self, keys: list[EvictionKey]) -> EvictionKey:
        """The key of a block that several idle chunks share (``keys``: theirs, one or more):
        the sum of their retention values, since evicting it costs every sharer its chunk;
        ties broken as the highest sharer's key."""
        top = max(keys)
        return (math.fsum(k[0] for k in keys), top[1], top[2], top[3])


@dataclass(frozen=True)
class LRUPolicy(EvictionPolicy):
    """Whole conversations, least recently used first (the paper's ablation)."""

    name: str = "lru"
    whole_conversation: bool = True
    time_dependent: bool = False

    def key(
        self, conv: Conversation, index: int, now: float, cost: ChunkCost, chunk_size: int
    ) -> EvictionKey:
        return (conv.last_active, 0.0, conv.conversation_id, float(index))

    def combine(self, keys: list[EvictionKey]) -> EvictionKey:
        """A shared block was used last when its most recent sharer was: the highest key (a
        radix cache's last access time of a node)."""
        return max(keys)


@dataclass(frozen=True)
class PrefixLRUPolicy(EvictionPolicy):
    """What prefix caches do (vLLM, SGLang): LRU, and within a sequence the tail first."""

    name: str = "prefix-lru"
    tail_first: bool = True
    time_dependent: bool = False

    def key(
        self, conv: Conversation, index: int, now: float, cost: ChunkCost, chunk_size: int
    ) -> EvictionKey:
        return (conv.last_active, 0.0, conv.conversation_id, float(-index))

    def combine(self, keys: list[EvictionKey]) -> EvictionKey:
        """The most recent sharer's key, as :meth:`LRUPolicy.combine`."""
        return max(keys)


@dataclass(frozen=True)
class ReturnPolicy(EvictionPolicy):
    """Recompute saved times the chance the conversation returns (module docstring)."""

    name: str = "return"
    think_s: float = 6.0
    """Mean think time between turns (exponential), seconds."""
    continue_p: float = 0.9
    """Chance that a finished turn is followed by another."""

    def key(
        self, conv: Conversation, index: int, now: float, cost: ChunkCost, chunk_size: int
    ) -> EvictionKey:
        if conv.queued_at is not None:
            return super().key(conv, index, now, cost, chunk_size)
        end, kv_end = (index + 1) * chunk_size, conv.kv_end
        context_len = end if end < kv_end else (kv_end if kv_end > 1 else 1)
        idle = now - conv.last_active - conv.keep_alive_s
        q = self.continue_p
        alive = q * math.exp(-idle / self.think_s) if idle > 0.0 else q
        value = conv.priority * cost(context_len) * alive / (alive + 1.0 - q)
        return (value, conv.last_active, conv.conversation_id, float(index))


ENDED_VALUE = -1.0
"""``oracle``'s value of a conversation with no next turn: below every live one's."""


@dataclass(frozen=True)
class OraclePolicy(EvictionPolicy):
    """Clairvoyant, cost-weighted Belady order (module docstring): ``Cost(context_len) /
    (next arrival - now)``, lowest first, the next arrival being ``last_active`` plus the
    conversation's entry in ``next_think_s``; conversations whose entry is None or missing
    (no next turn) first of all, least recently active first. For the simulator only: the map
    is written by whoever knows the future (``pensieve.bench.loadgen.run_load``) while the
    conversation's turn is queued or running, so an idle conversation's key never changes
    under the eviction index."""

    name: str = "oracle"
    key_may_grow: bool = True
    weigh_cost: bool = True
    """False: plain Belady (``1 / (next arrival - now)``: the conversation needed last goes
    first, its leading chunks first), blind to what a chunk costs to recompute."""
    next_think_s: Mapping[str, float | None] = field(default_factory=dict, compare=False,
                                                     repr=False)
    """conversation id -> seconds from the end of its current turn to the arrival of the
    next (None: no next turn)."""

    def key(
        self, conv: Conversation, index: int, now: float, cost: ChunkCost, chunk_size: int
    ) -> EvictionKey:
        if conv.queued_at is not None:
            return super().key(conv, index, now, cost, chunk_size)
        think = self.next_think_s.get(conv.conversation_id)
        if think is None:
            return (ENDED_VALUE, conv.last_active, conv.conversation_id, float(index))
        end, kv_end = (index + 1) * chunk_size, conv.kv_end
        context_len = end if end < kv_end else (kv_end if kv_end > 1 else 1)
        wait = conv.last_active + think - now
        saved = cost(context_len) if self.weigh_cost else 1.0
        value = conv.priority * saved / (wait if wait > 1e-3 else 1e-3)
        return (value, conv.last_active, conv.conversation_id, float(index))


POLICIES: dict[str, EvictionPolicy] = {
    "pensieve": EvictionPolicy(),
    "gpu-only": EvictionPolicy(name="gpu-only", uses_cpu_tier=False),
    "lru": LRUPolicy(),
    "prefix-lru": PrefixLRUPolicy(),
    "return": ReturnPolicy(),
    "stateless": EvictionPolicy(name="stateless", uses_cpu_tier=False, keeps_kv=False),
}


def get_policy(name: str) -> EvictionPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown cache_policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name]
