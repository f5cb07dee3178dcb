"""N simulated replicas, three routings, a shared KV tier over a network, and a replica lost.

:class:`RoutedCluster` is a :class:`~pensieve.bench.engine_api.BenchEngine` over N
:class:`~pensieve.sim.simulator.SimEngine` replicas, each on its own virtual clock (as
``replicas_sim.ReplicatedSim``; the load generator's clock reads the start of the next step or
transfer). Routings:

* ``affinity``: today's default, :class:`~pensieve.core.routing.AffinityRouter` (rendezvous
  order, bounded load on requests in flight). No shared tier: a turn that lands on a replica
  without its history recomputes it (the history is prepended to its input).
* ``spill``: the replica of the conversation's last turn (a new one: its rendezvous first
  choice) unless its waiting tokens pass ``bound``
  (:func:`~pensieve.core.routing.spill_route`); a moved turn's KV comes from the shared tier.
* ``least``: the replica with the fewest waiting tokens, the KV from the shared tier.

Waiting tokens of a replica: the prompt tokens its requests still have to compute (the
scheduler's pending ranges, less what the shared tier delivers), plus the new tokens of turns
whose KV is still on the wire to it.

Shared tier (``spill``, ``least``)::

    turn ends on replica i --write (its new KV, i's send link, FIFO)--> shared tier
    turn routed to j without the history --read (j's receive link, FIFO, not before the
        history's last write is done)--> j; then the turn is added to j, and the positions
        read are not computed (SimExecutor.load_from_shared): only its new tokens are

Each replica has one network link of ``gbps`` gigabits/s each way; the tier itself is assumed
to keep up with every link at once. The turn waits for its read before it is added (its TTFT
includes the wait). Bytes: ``kv_bytes_per_token`` per token of context.

Replica loss (``fail_at``, ``fail_replica``): at that time the replica's engine is dropped; its
requests in flight (and transfers to it) are sent again through the routing of the remaining
replicas (the ingress's retry), each from its whole history, and the router never picks it
again. Its conversations' next turns go elsewhere: recomputed (``affinity``) or read from the
shared tier.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

from pensieve.bench.engine_api import VirtualClock
from pensieve.core.routing import AffinityRouter, least_loaded, preference, spill_route
from pensieve.core.sampling_params import SamplingParams
from pensieve.engine.request_output import RequestOutput

ROUTINGS = ("affinity", "spill", "least")
POLL_S = 0.05
"""Longest jump of the load generator's clock while only transfers are due."""


class _Link:
    """One direction of a replica's network link: transfers one after another."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self.free_at = 0.0
        self.bytes = 0
        self.log: list[tuple[float, float, int]] = []
        """(start, end, bytes) of every transfer."""

    def send(self, now: float, nbytes: int) -> float:
        start = max(now, self.free_at)
        self.free_at = start + nbytes / self.bytes_per_s
        self.bytes += nbytes
        self.log.append((start, self.free_at, nbytes))
        return self.free_at


class RoutedCluster:
    """``make_replica(clock)`` builds one replica (a ``SimEngine``) on the given clock."""

    def __init__(self, num_replicas: int, make_replica: Callable[[VirtualClock], Any],
                 clock: VirtualClock, routing: str, kv_bytes_per_token: int,
                 gbps: float | None = None, bound: float = 0.0,
                 fail_at: float | None = None, fail_replica: int = 0) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        if routing != "affinity" and not gbps:
            raise ValueError("a shared tier needs a network rate (gbps)")
        self.clock = clock
        self.routing = routing
        self.bound = bound
        self.kv_bytes = kv_bytes_per_token
        self.names = [f"replica-{i}" for i in range(num_replicas)]
        self.clocks = [VirtualClock(clock.now()) for _ in range(num_replicas)]
        self.replicas = [make_replica(c) for c in self.clocks]
        self.alive = [True] * num_replicas
        self.fail_at, self.fail_replica = fail_at, fail_replica
        rate = (gbps or 0.0) * 1e9 / 8
        self.rx = [_Link(rate) for _ in range(num_replicas)] if gbps else []
        self.tx = [_Link(rate) for _ in range(num_replicas)] if gbps else []
        self.loads = [0] * num_replicas
        self.served = [0] * num_replicas
        self.moved_turns = 0
        self.loaded_tokens = 0
        """Context tokens read from the shared tier (not computed)."""
        self.recomputed_history_tokens = 0
        """History tokens prepended to a turn on a replica that did not hold them."""
        self._history: dict[str, list[int]] = {}
        self._held: list[dict[str, int]] = [{} for _ in range(num_replicas)]
        self._stored: dict[str, tuple[int, float]] = {}
        """conversation -> (history tokens in the shared tier, when their write is done)."""
        self._last: dict[str, int] = {}
        self._where: dict[str, tuple[int, str | None]] = {}
        self._req: dict[str, tuple[list[int], SamplingParams, float, str | None]] = {}
        """request id -> (its new tokens, params, arrival, conversation): for a retry."""
        self._wire: list[list[tuple[float, str, list[int], int, int]]] = [
            [] for _ in range(num_replicas)]
        """Per replica, a heap of (ready at, request id, prompt, loaded lo, loaded hi)."""
        self._wire_tokens = [0] * num_replicas
        self._affinity = AffinityRouter(self.names)

    # ------------------------------------------------------------------ routing
    def waiting_tokens(self, i: int) -> int:
        """Prompt tokens replica ``i`` still has to compute (module docstring)."""
        ex = self.replicas[i].executor
        sched = self.replicas[i].scheduler
        n = self._wire_tokens[i]
        for req in list(sched.waiting) + sched.running:
            span = ex.loaded_span(req.request_id)
            for lo, hi in req.pending:
                n += hi - lo
                if span is not None:
                    n -= max(0, min(hi, span[1]) - max(lo, span[0]))
        return n

    def _route(self, key: str, cid: str | None) -> int:
        live = [i for i, up in enumerate(self.alive) if up]
        if self.routing == "affinity":
            names = [self.names[i] for i in live]
            router = (self._affinity if len(live) == len(self.names)
                      else AffinityRouter(names))
            return live[router.route(key, [self.loads[i] for i in live])]
        waiting = [self.waiting_tokens(i) if up else 0 for i, up in enumerate(self.alive)]
        if self.routing == "least":
            return least_loaded(waiting, self.alive)
        owner = self._last.get(cid) if cid is not None else None
        if owner is None or not self.alive[owner]:
            owner = live[preference(key, [self.names[i] for i in live])[0]]
        return spill_route(owner, waiting, self.bound, self.alive)

    # ------------------------------------------------------------------ BenchEngine
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None,
                    conversation_id: str | None = None) -> None:
        now = self.clock.now() if arrival_time is None else arrival_time
        self._req[request_id] = (list(prompt_token_ids), params, now, conversation_id)
        self._place(request_id, now)

    def _place(self, request_id: str, now: float) -> None:
        new, params, arrival, cid = self._req[request_id]
        key = "id:" + (cid or request_id)
        i = self._route(key, cid)
        prompt, lo, hi, ready = list(new), 0, 0, now
        if cid is not None:
            history = self._history.get(cid, [])
            held = self._held[i].get(cid, 0)
            last = self._last.get(cid)
            if last is not None and last != i:
                self.moved_turns += 1
            self._last[cid] = i
            prompt = history[held:] + prompt
            missing = len(history) - held
            if missing > 0 and self.rx:
                stored, written = self._stored.get(cid, (0, 0.0))
                lo, hi = held, held + min(missing, max(0, stored - held))
                if hi > lo:
                    ready = self.rx[i].send(max(now, written), (hi - lo) * self.kv_bytes)
                    self.loaded_tokens += hi - lo
                self.recomputed_history_tokens += missing - (hi - lo)
            elif missing > 0:
                self.recomputed_history_tokens += missing
        self.loads[i] += 1
        self.served[i] += 1
        self._where[request_id] = (i, cid)
        if ready > now:
            heapq.heappush(self._wire[i], (ready, request_id, prompt, lo, hi))
            self._wire_tokens[i] += len(prompt) - (hi - lo)
        else:
            self._admit(i, request_id, prompt, lo, hi, max(now, arrival))

    def _admit(self, i: int, request_id: str, prompt: list[int], lo: int, hi: int,
               now: float) -> None:
        rep = self.replicas[i]
        if not rep.has_unfinished():  # idle until this request arrives
            self.clocks[i].sleep_until(now)
        new, params, arrival, cid = self._req[request_id]
        rep.executor.load_from_shared(request_id, lo, hi)
        rep.add_request(request_id, prompt, params, arrival_time=now, conversation_id=cid)

    def has_unfinished(self) -> bool:
        return any(up and (r.has_unfinished() or self._wire[i])
                   for i, (r, up) in enumerate(zip(self.replicas, self.alive)))

    def _next_time(self, i: int) -> float | None:
        if not self.alive[i]:
            return None
        if self.replicas[i].has_unfinished():
            return self.clocks[i].now()
        return self._wire[i][0][0] if self._wire[i] else None

    def step(self) -> list[RequestOutput]:
        times = [(t, i) for i in range(len(self.replicas))
                 if (t := self._next_time(i)) is not None]
        if not times:
            return []
        t, i = min(times)
        if not self.replicas[i].has_unfinished() and t > self.clock.now() + POLL_S:
            # only a transfer is due: move on a little, so the load generator sends the
            # turns due meanwhile on time
            self.clock.sleep_until(self.clock.now() + POLL_S)
            return []
        if self.fail_at is not None and t >= self.fail_at and self.alive[self.fail_replica]:
            self._fail(self.fail_replica, self.fail_at)
            return []
        self.clock.sleep_until(t)
        while self._wire[i] and self._wire[i][0][0] <= t:
            ready, rid, prompt, lo, hi = heapq.heappop(self._wire[i])
            self._wire_tokens[i] -= len(prompt) - (hi - lo)
            self._admit(i, rid, prompt, lo, hi, ready)
        if not self.replicas[i].has_unfinished():
            return []
        outs = self.replicas[i].step()
        for out in outs:
            self._finish(i, out)
        return outs

    def _finish(self, i: int, out: RequestOutput) -> None:
        self.replicas[i].executor.forget_loaded(out.request_id)
        where = self._where.pop(out.request_id, None)
        self._req.pop(out.request_id, None)
        if where is None:
            return
        self.loads[i] -= 1
        cid = where[1]
        if cid is None or out.finish_reason == "error":
            return
        full = list(out.prompt_token_ids) + list(out.output_token_ids)
        self._history[cid] = full
        self._held[i][cid] = len(full)
        if self.tx:  # the turn's new KV to the shared tier
            stored = self._stored.get(cid, (0, 0.0))[0]
            done = self.tx[i].send(self.clocks[i].now(),
                                   max(0, len(full) - stored) * self.kv_bytes)
            self._stored[cid] = (len(full), done)

    def _fail(self, k: int, t: float) -> None:
        """Replica ``k`` dies at ``t``: its requests are sent again elsewhere."""
        self.alive[k] = False
        self._held[k].clear()
        lost = [rid for rid, (i, _) in self._where.items() if i == k]
        self._wire[k].clear()
        self._wire_tokens[k] = 0
        for rid in lost:
            self._where.pop(rid)
            self.loads[k] -= 1
            cid = self._req[rid][3]
            if cid is not None and self._last.get(cid) == k:
                del self._last[cid]
            self._place(rid, t)

    # ------------------------------------------------------------------ reports
    def cache_stats(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for r in self.replicas:
            for k, v in r.cache_stats().items():
                if isinstance(v, (int, float)):
                    total[k] = total.get(k, 0) + int(v)
        return total

    @property
    def num_running(self) -> int:
        return sum(r.num_running for r, up in zip(self.replicas, self.alive) if up)

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r, up in zip(self.replicas, self.alive) if up)

    def network(self, t0: float, t1: float, bin_s: float = 10.0) -> dict[str, Any]:
        """The shared tier's traffic in ``[t0, t1)``: mean and peak (over ``bin_s`` bins) of
        the busiest replica's read and write rates, as a share of the link's rate, and the
        reads' wait (queue and transfer) per moved turn."""
        if not self.rx:
            return {}
        out: dict[str, Any] = {"link_gbps": self.rx[0].bytes_per_s * 8 / 1e9}
        for name, links in (("read", self.rx), ("write", self.tx)):
            per = [_busy(link.log, t0, t1, bin_s) for link in links]
            out[f"{name}_gb"] = round(sum(link.bytes for link in links) / 1e9, 2)
            out[f"{name}_util_mean_max"] = round(max(m for m, _ in per), 3)
            out[f"{name}_util_peak"] = round(max(p for _, p in per), 3)
        waits = [e - s for link in self.rx for s, e, _ in link.log if t0 <= s < t1]
        out["read_s_mean"] = round(sum(waits) / len(waits), 3) if waits else 0.0
        return out

    def routing_stats(self) -> dict[str, Any]:
        return {"served_per_replica": list(self.served), "moved_turns": self.moved_turns,
                "loaded_tokens": self.loaded_tokens,
                "recomputed_history_tokens": self.recomputed_history_tokens}


def _busy(log: Sequence[tuple[float, float, int]], t0: float, t1: float,
          bin_s: float) -> tuple[float, float]:
    """Share of ``[t0, t1)`` a link was busy (mean, and the busiest ``bin_s`` bin)."""
    nb = max(1, int((t1 - t0) // bin_s))
    bins = [0.0] * nb
    for s, e, _ in log:
        s, e = max(s, t0), min(e, t0 + nb * bin_s)
        while e > s:
            b = int((s - t0) // bin_s)
            cut = min(e, t0 + (b + 1) * bin_s)
            bins[b] += cut - s
            s = cut
    return sum(bins) / (nb * bin_s), max(bins) / bin_s
