"""Ray Serve request router for the engine replicas: conversation affinity, with bounded load
or, over a shared KV tier, a spill on waiting prompt tokens.

Ray Serve calls :meth:`AffinityRequestRouter.choose_replicas` in the process that holds the
deployment handle (the ingress) for every request to the engine deployment. The request's
routing key travels as the ``routing_key`` keyword argument of the call (the ingress computes
it with :func:`pensieve.core.routing.conversation_key`); the replicas are ranked by
:class:`pensieve.core.routing.AffinityRouter` over their ids, with the ongoing requests Ray
Serve's queue-length cache reports for each as the loads. The first rank is the replica the
bounded-load rule picks; the others follow in the key's rendezvous order.

Ray Serve tries the ranks in order and moves to the next one when the replica of a rank does not
answer its queue-length probe within the probe's deadline (0.1 s at first). A replica busy
with a step on a loaded host can miss that deadline while alive and well, and the turn then goes
to the key's next choice, away from its KV (the likely cause of the one continued turn in 16
that missed the cache on a busy 2-core machine with both replicas up). So for
:data:`PATIENCE_S` after a request is queued only its first rank is offered (Ray Serve probes
it again, with a longer deadline and a backoff, until it answers); after that, every rank, so a
replica that is alive but hung still gives its keys to their next choice. A replica that died
leaves the candidates at once (a probe that finds the actor dead drops it), and its keys move
to their next choice while every other key stays put.

With a shared KV tier (``--kv-remote``) a turn that moves reads its history's KV from the tier
instead of recomputing it, and the router balances on **waiting prompt tokens** instead
(``spill_tokens`` set, ``--route-spill-tokens``, default
:data:`~pensieve.core.routing.DEFAULT_SPILL_TOKENS`): the first rank is
:func:`~pensieve.core.routing.spill_ranking`'s choice: the key's owner (the replica this
router last ranked first for the key, else the key's rendezvous first choice) unless the owner
has more than ``spill_tokens`` prompt tokens waiting, then the replica with the fewest (when it
has fewer).
Each replica reports its waiting tokens (:data:`WAITING_TOKENS`, the engine's
``num_waiting_tokens``) in its Ray Serve routing stats (``record_routing_stats``, polled by the
controller every ``request_routing_stats_period_s``), so the router sees them up to about a
period late. The rest follow in the key's rendezvous order; :data:`PATIENCE_S` holds as above.

A request with a ``replica_rank`` keyword argument instead goes to the replica of that rank in
the order of replica ids (``/metrics`` asks each replica this way).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from pensieve.core.routing import AffinityRouter, preference, spill_ranking

PATIENCE_S = 10.0
"""Seconds a request waits for its first-ranked replica before the others are offered."""

WAITING_TOKENS = "waiting_tokens"
"""The routing stat a replica reports: prompt tokens its engine has still to compute."""

OWNERS_KEPT = 1 << 16
"""Routing keys whose last replica the router remembers (the least recently routed go)."""


def waiting_tokens(stats: Mapping[str, Any] | None) -> int:
    """A replica's waiting prompt tokens from its routing stats (0 before its first report)."""
    try:
        return max(0, int((stats or {}).get(WAITING_TOKENS, 0)))
    except (TypeError, ValueError):
        return 0


def rank_replicas(key: str, ids: list[str], loads: list[int], load_factor: float = 1.25,
                  min_load: int = 16) -> list[int]:
    """Indices of the replicas ``ids`` in the order to try for ``key``: the bounded-load
    choice first, then the rest in the key's rendezvous order."""
    router = AffinityRouter(ids, load_factor, min_load)
    first = router.route(key, loads)
    return [first] + [i for i in preference(key, ids) if i != first]


def ranks_to_offer(ranked: list[int], waited_s: float, patience_s: float = PATIENCE_S
                   ) -> list[list[int]]:
    """The ranks offered to Ray Serve for a request queued ``waited_s`` ago: the first alone
    while ``waited_s < patience_s``, then each in ``ranked``'s order (module docstring)."""
    if waited_s < patience_s:
        return [ranked[:1]]
    return [[i] for i in ranked]


class AffinityRequestRouter(RequestRouter):
    """Ray Serve's extension point (``RequestRouterConfig.request_router_class``) running
    :class:`~pensieve.core.routing.AffinityRouter`."""

    load_factor: float = 1.25
    min_load: int = 16
    spill_tokens: int | None = None
    """Spill bound in waiting prompt tokens (a shared KV tier); None: bounded load."""

    def initialize_state(self, load_factor: float = 1.25, min_load: int = 16,
                         spill_tokens: int | None = None, **kwargs: object) -> None:
        """Called by Ray Serve with ``RequestRouterConfig.request_router_kwargs``."""
        self.load_factor = float(load_factor)
        self.min_load = int(min_load)
        self.spill_tokens = None if spill_tokens is None else int(spill_tokens)
        self.owners: OrderedDict[str, str] = OrderedDict()
        """Routing key -> the replica id last ranked first for it (spill mode)."""

    def rank(self, key: str, replicas: list[RunningReplica]) -> list[int]:
        """Indices of ``replicas`` (sorted by id) in the order to try for ``key``."""
        ids = [r.replica_id.unique_id for r in replicas]
        if self.spill_tokens is None:
            loads = [self.replica_queue_len_cache.get(r.replica_id) or 0 for r in replicas]
            return rank_replicas(key, ids, loads, self.load_factor, self.min_load)
        waiting = [waiting_tokens(r.routing_stats) for r in replicas]
        last = self.owners.get(key)
        owner = ids.index(last) if last in ids else None
        ranked = spill_ranking(key, ids, waiting, self.spill_tokens, owner)
        if key:
            self.owners[key] = ids[ranked[0]]
            self.owners.move_to_end(key)
            if len(self.owners) > OWNERS_KEPT:
                self.owners.popitem(last=False)
        return ranked

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        replicas = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        kwargs = pending_request.kwargs if pending_request is not None else {}
        if "replica_rank" in kwargs:
            return [[replicas[int(kwargs["replica_rank"]) % len(replicas)]]]
        ranked = self.rank(str(kwargs.get("routing_key") or ""), replicas)
        waited = 0.0
        if pending_request is not None:
            waited = time.time() - pending_request.created_at  # Ray Serve's own clock
            # back off between attempts (Ray Serve retries at once otherwise)
            pending_request.routing_context.should_backoff = True
        return [[replicas[i] for i in rank] for rank in ranks_to_offer(ranked, waited)]
