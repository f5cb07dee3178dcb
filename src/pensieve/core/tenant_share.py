"""Per-tenant share of each tier that retention hints cannot exceed.

A conversation's ``priority`` and ``keep_alive_s`` raise its retention value, so without a
bound one tenant's hints could push every other tenant's KV out of both tiers. Each tenant
that sets hints gets at most ``share`` of each tier's blocks *with* them: while the chunks of
its hinted conversations in a tier number more than ``share * blocks``, those conversations
are demoted (priority :data:`DEMOTED`, no keep-alive), so they are evicted
before any conversation held at plain value, and the hints can no longer take another
tenant's cached tokens. Once they fall back within the share the hints apply again.

Counts follow what changes: a conversation is counted anew (one pass over its chunks) when it
gets hints or a turn of it ends, and an eviction of one of its chunks moves one count. A flip
of a tenant's state touches its hinted conversations only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pensieve.core.conversation import Conversation, Tier

DEMOTED = 1e-6
"""Priority of a tenant's hinted conversations while it is over its share (whatever they
asked for), far below the default 1."""


class TenantShare:
    """Chunks per tier of each tenant's hinted conversations, and which tenants are over."""

    def __init__(self, share: float, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"tenant_kv_share must be in (0, 1], got {share}")
        self.limit = {Tier.GPU: share * num_gpu_blocks, Tier.CPU: share * num_cpu_blocks}
        self.held: dict[str, dict[Tier, int]] = {}
        """tenant -> chunks per tier of its hinted conversations (as last counted)."""
        self.counted: dict[Conversation, dict[Tier, int]] = {}
        self.members: dict[str, set[Conversation]] = {}
        self.over: set[str] = set()

    def track(self, conv: Conversation) -> set[Conversation]:
        """``conv`` has hints (and a tenant): count its chunks. Returns the conversations
        whose effective hints may have changed."""
        counts = {Tier.GPU: 0, Tier.CPU: 0}
        for ch in conv.chunks:
            if ch.tier is Tier.GPU or ch.tier is Tier.CPU:
                counts[ch.tier] += 1
        old = self.counted.get(conv)
        self.counted[conv] = counts
        self.members.setdefault(conv.tenant, set()).add(conv)
        held = self.held.setdefault(conv.tenant, {Tier.GPU: 0, Tier.CPU: 0})
        for tier, n in counts.items():
            held[tier] += n - (old[tier] if old else 0)
        return self._settle(conv.tenant) | {conv}

    def forget(self, conv: Conversation) -> set[Conversation]:
        """``conv`` is deleted or has no hints any more."""
        counts = self.counted.pop(conv, None)
        if counts is None:
            return set()
        self.members[conv.tenant].discard(conv)
        for tier, n in counts.items():
            self.held[conv.tenant][tier] -= n
        return self._settle(conv.tenant)

    def moved(self, conv: Conversation, src: Tier, dst: Tier) -> set[Conversation]:
        """One chunk of ``conv`` moved from ``src`` to ``dst`` (an eviction)."""
        counts = self.counted.get(conv)
        if counts is None:
            return set()
        held = self.held[conv.tenant]
        counts[src] -= 1
        held[src] -= 1
        if dst is Tier.GPU or dst is Tier.CPU:
            counts[dst] += 1
            held[dst] += 1
        return self._settle(conv.tenant)

    def _settle(self, tenant: str) -> set[Conversation]:
        held = self.held[tenant]
        over = any(held[t] > self.limit[t] for t in (Tier.GPU, Tier.CPU))
        if over == (tenant in self.over):
            return set()
        if over:
            self.over.add(tenant)
        else:
            self.over.discard(tenant)
        return set(self.members[tenant])

    def apply(self, convs: Iterable[Conversation], rekey: Callable[[Conversation], None]
              ) -> None:
        """The policy reads each of ``convs``' hints as its tenant's share allows; those whose
        hints it reads change are keyed again (``rekey``)."""
        for conv in convs:
            effective = self.effective(conv)
            if effective != (conv.priority, conv.keep_alive_s):
                conv.priority, conv.keep_alive_s = effective
                rekey(conv)

    def effective(self, conv: Conversation) -> tuple[float, float]:
        """(priority, keep_alive_s) the policy should read for ``conv``."""
        priority, keep_alive = conv.hints
        if conv.tenant in self.over and conv in self.counted:
            return DEMOTED, 0.0
        return priority, keep_alive
