"""Ray Serve request router for the engine replicas: conversation affinity, bounded load.

Ray Serve calls :meth:`AffinityRequestRouter.choose_replicas` in the process that holds the
deployment handle (the ingress) for every request to the engine deployment. The request's
routing key travels as the ``routing_key`` keyword argument of the call (the ingress computes
it with :func:`pensieve.core.routing.conversation_key`); the replicas are ranked by
:class:`pensieve.core.routing.AffinityRouter` over their ids, with the ongoing requests Ray
Serve's queue-length cache reports for each as the loads. The first rank is the replica the
bounded-load rule picks; the others follow in the key's rendezvous order, so Ray Serve falls
back to the key's next choice when the first rejects the request (queue full) and, when a
replica dies, its keys move to their next choice while every other key stays put.

A request with a ``replica_rank`` keyword argument instead goes to the replica of that rank in
the order of replica ids (``/metrics`` asks each replica this way).
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from pensieve.core.routing import AffinityRouter, preference


def rank_replicas(key: str, ids: list[str], loads: list[int], load_factor: float = 1.25,
                  min_load: int = 16) -> list[int]:
    """Indices of the replicas ``ids`` in the order to try for ``key``: the bounded-load
    choice first, then the rest in the key's rendezvous order."""
    router = AffinityRouter(ids, load_factor, min_load)
    first = router.route(key, loads)
    return [first] + [i for i in preference(key, ids) if i != first]


class AffinityRequestRouter(RequestRouter):
    """Ray Serve's extension point (``RequestRouterConfig.request_router_class``) running
    :class:`~pensieve.core.routing.AffinityRouter`."""

    load_factor: float = 1.25
    min_load: int = 16

    def initialize_state(self, load_factor: float = 1.25, min_load: int = 16,
                         **kwargs: object) -> None:
        """Called by Ray Serve with ``RequestRouterConfig.request_router_kwargs``."""
        self.load_factor = float(load_factor)
        self.min_load = int(min_load)

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
        key = str(kwargs.get("routing_key") or "")
        ids = [r.replica_id.unique_id for r in replicas]
        loads = [self.replica_queue_len_cache.get(r.replica_id) or 0 for r in replicas]
        return [[replicas[i]] for i in rank_replicas(key, ids, loads, self.load_factor,
                                                            self.min_load)]
