"""N simulated replicas behind one router, on one virtual timeline.

:class:`ReplicatedSim` is a :class:`~pensieve.bench.engine_api.BenchEngine` over N engines
(normally :class:`~pensieve.sim.simulator.SimEngine`, each on its own virtual clock: each
replica is its own GPU, busy while the others are). Every request is routed by a router of
:mod:`pensieve.core.routing` on its conversation key and the replicas' requests in flight.

Histories. A conversation's turns may land on different replicas (random routing, or a
spill from a hot replica). The wrapper keeps every conversation's full token history, so a
replica that holds an older part of it (or none) gets the missing turns prepended to the new
input: the context is always the whole conversation, and only the KV a replica holds is reused,
as with replicas that share a conversation store.

Time. The load generator's clock (``clock``) reads the start of the next step to run: of all
replicas with work, the one whose clock is earliest steps next, so a request is never scheduled
before it arrived; an idle replica's clock jumps to the arrival of its next request. Each
output's times are on its replica's clock (the same time base).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from pensieve.bench.engine_api import VirtualClock
from pensieve.core.routing import AffinityRouter, RandomRouter
from pensieve.core.sampling_params import SamplingParams
from pensieve.engine.request_output import RequestOutput


class _Replica(Protocol):
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None,
                    conversation_id: str | None = None) -> None: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def cache_stats(self) -> dict[str, int]: ...


Router = AffinityRouter | RandomRouter


class ReplicatedSim:
    """``make_replica(clock)`` builds one replica on the given virtual clock."""

    def __init__(self, num_replicas: int, make_replica: Callable[[VirtualClock], Any],
                 clock: VirtualClock, router: Router | None = None) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.clock = clock
        self.clocks = [VirtualClock(clock.now()) for _ in range(num_replicas)]
        self.replicas: list[_Replica] = [make_replica(c) for c in self.clocks]
        self.router: Router = (router if router is not None
                               else AffinityRouter(replica_names(num_replicas)))
        if len(self.router.replicas) != num_replicas:
            raise ValueError("the router's replicas differ from num_replicas")
        self.loads = [0] * num_replicas
        """Requests in flight per replica (routed, not yet finished)."""
        self.served = [0] * num_replicas
        """Requests routed to each replica so far."""
        self.moved_turns = 0
        """Turns routed to a replica other than the one that served the conversation's
        previous turn."""
        self._history: dict[str, list[int]] = {}
        """conversation id -> its full token history (every finished turn's context and
        output)."""
        self._held: list[dict[str, int]] = [{} for _ in range(num_replicas)]
        """Per replica, conversation id -> length of the history it holds."""
        self._last: dict[str, int] = {}
        self._where: dict[str, tuple[int, str | None]] = {}
        """request id -> (replica, conversation id)."""

    # ------------------------------------------------------------------ BenchEngine
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None,
                    conversation_id: str | None = None) -> None:
        now = self.clock.now() if arrival_time is None else arrival_time
        key = "id:" + (conversation_id or request_id)
        i = self.router.route(key, self.loads)
        prompt = list(prompt_token_ids)
        if conversation_id is not None:
            history = self._history.get(conversation_id, [])
            held = self._held[i].get(conversation_id, 0)
            prompt = history[held:] + prompt  # the turns this replica has not seen
            last = self._last.get(conversation_id)
            if last is not None and last != i:
                self.moved_turns += 1
            self._last[conversation_id] = i
        rep = self.replicas[i]
        if not rep.has_unfinished():  # idle until this request arrives
            self.clocks[i].sleep_until(now)
        rep.add_request(request_id, prompt, params, arrival_time=now,
                        conversation_id=conversation_id)
        self.loads[i] += 1
        self.served[i] += 1
        self._where[request_id] = (i, conversation_id)

    def has_unfinished(self) -> bool:
        return any(r.has_unfinished() for r in self.replicas)

    def step(self) -> list[RequestOutput]:
        busy = [i for i, r in enumerate(self.replicas) if r.has_unfinished()]
        if not busy:
            return []
        i = min(busy, key=lambda j: self.clocks[j].now())
        self.clock.sleep_until(self.clocks[i].now())
        outs = self.replicas[i].step()
        for out in outs:
            where = self._where.pop(out.request_id, None)
            if where is None:
                continue
            self.loads[i] -= 1
            _, cid = where
            if cid is not None and out.finish_reason != "error":
                # the replica's context for the turn = what it held + what it was sent
                full = list(out.prompt_token_ids) + list(out.output_token_ids)
                self._history[cid] = full
                self._held[i][cid] = len(full)
        return outs

    def cache_stats(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for r in self.replicas:
            for k, v in r.cache_stats().items():
                if isinstance(v, (int, float)):
                    total[k] = total.get(k, 0) + int(v)
        return total

    @property
    def num_running(self) -> int:
        return sum(int(getattr(r, "num_running", 0)) for r in self.replicas)

    @property
    def num_waiting(self) -> int:
        return sum(int(getattr(r, "num_waiting", 0)) for r in self.replicas)

    def routing_stats(self) -> dict[str, Any]:
        total = sum(self.served)
        return {"served_per_replica": list(self.served), "moved_turns": self.moved_turns,
                "requests": total,
                "max_over_mean_load": (max(self.served) * len(self.served) / total
                                       if total else None)}


def replica_names(n: int) -> Sequence[str]:
    """The names :class:`ReplicatedSim` gives its replicas (routers are built over them)."""
    return [f"replica-{i}" for i in range(n)]
