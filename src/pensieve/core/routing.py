"""Which replica serves a conversation: affinity routing with bounded load.

A stateful server keeps a conversation's KV on the replica that served its last turn, so every
turn of a conversation should go back there. The rule, shared by the real replica router and the
simulator:

* **Key.** The conversation id when the client sends one; otherwise a stable hash of the
  conversation's first messages (:func:`conversation_key`), so that clients which re-send the
  whole history land where the history is cached.
* **Order.** Rendezvous (highest-random-weight) hashing ranks the replicas for each key
  (:func:`preference`): every key has its own stable order, replicas that join or leave move
  only the keys they win or held, and keys spread evenly.
* **Bounded load.** The first replica in that order whose load is under
  ``max(min_load, ceil(load_factor * (total + 1) / n))`` takes the turn ("consistent hashing
  with bounded loads", Mirrokni et al. 2018): one hot replica spills to the key's next choice
  instead of queueing. With ``load_factor`` >= 1 some replica always qualifies. A turn that
  spills loses its KV (the next replica recomputes the history), so below ``min_load``
  requests in flight a replica is never counted hot: an engine batches that many anyway.

:class:`RandomRouter` ignores the key (the contrast in the benchmarks).

Routing with a shared KV tier (a moved conversation's KV is read from the tier, not
recomputed), measured in the simulator (``benchmarks/replicas_routing.py``):

* :func:`spill_route`: the conversation's owner (the replica of its last turn) unless the
  owner's waiting tokens pass a bound; then the replica with the fewest waiting tokens.
  :func:`spill_ranking` orders all the replicas for a key by it (the real replicas' router,
  ``pensieve.replicas.router``, with :data:`DEFAULT_SPILL_TOKENS`).
* :func:`least_loaded`: the replica with the fewest waiting tokens, wherever the KV is.

Pure Python, no torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Sequence
from typing import Any

DEFAULT_SPILL_TOKENS = 16384
"""Waiting prompt tokens on a conversation's replica past which its turn spills (with a shared
KV tier): the best bound the simulator found at 4 and 8 replicas (docs/benchmarks.md,
"Routing across replicas with a shared KV tier"). That many waiting tokens are ~0.9 s of
prefill (llama3.1-8b shape), and reading a mean ~30k-token coding-agent history over 25 Gb/s
takes ~1.3 s: below that queue, waiting for the owner costs less than moving."""


def conversation_key(messages: Sequence[Any], conversation_id: str | None = None) -> str:
    """Routing key of a request: its conversation id, else a hash of its opening messages.

    ``messages`` are OpenAI chat messages (dicts with ``role`` and ``content``) or plain
    strings. The opening is every message up to and including the first ``user`` message
    (system prompts and the first question; the first message when none has that role): the
    same on every turn of a conversation whose client re-sends the history."""
    if conversation_id:
        return "id:" + conversation_id
    msgs = list(messages)
    first_user = next((i for i, m in enumerate(msgs)
                       if isinstance(m, dict) and m.get("role") == "user"), 0)
    head = [_message_text(m) for m in msgs[: first_user + 1]]
    digest = hashlib.blake2b(json.dumps(head, ensure_ascii=False).encode("utf-8", "replace"),
                             digest_size=16).hexdigest()
    return "msg:" + digest


def _message_text(m: Any) -> Any:
    if isinstance(m, dict):
        return [m.get("role"), m.get("content")]
    return m


def _weight(key: str, replica: str) -> int:
    h = hashlib.blake2b(f"{replica}\x00{key}".encode("utf-8", "replace"), digest_size=8)
    return int.from_bytes(h.digest(), "big")


def preference(key: str, replicas: Sequence[str]) -> list[int]:
    """Indices of ``replicas`` in the key's rendezvous order (its first choice first)."""
    return sorted(range(len(replicas)), key=lambda i: _weight(key, replicas[i]), reverse=True)


class AffinityRouter:
    """Conversation-affinity routing over named replicas with bounded load."""

    def __init__(self, replicas: Sequence[str], load_factor: float = 1.25,
                 min_load: int = 16) -> None:
        if not replicas:
            raise ValueError("at least one replica is needed")
        if len(set(replicas)) != len(replicas):
            raise ValueError(f"replica names must be unique, got {list(replicas)}")
        if not load_factor >= 1.0:
            raise ValueError(f"load_factor must be >= 1, got {load_factor}")
        if min_load < 1:
            raise ValueError(f"min_load must be >= 1, got {min_load}")
        self.replicas = list(replicas)
        self.load_factor = load_factor
        self.min_load = min_load

    def capacity(self, loads: Sequence[int]) -> int:
        """Most requests a replica may hold before a new one spills to the next choice."""
        return max(self.min_load,
                   math.ceil(self.load_factor * (sum(loads) + 1) / len(self.replicas)))

    def route(self, key: str, loads: Sequence[int]) -> int:
        """Replica index for a request with routing key ``key``; ``loads[i]``: requests in
        flight on replica ``i`` (same order as ``replicas``)."""
        if len(loads) != len(self.replicas):
            raise ValueError(f"{len(loads)} loads for {len(self.replicas)} replicas")
        cap = self.capacity(loads)
        order = preference(key, self.replicas)
        for i in order:
            if loads[i] < cap:
                return i
        return order[0]  # unreachable with load_factor >= 1; kept total


class RandomRouter:
    """Uniformly random replica, whatever the key (no affinity)."""

    def __init__(self, replicas: Sequence[str], seed: int = 0) -> None:
        if not replicas:
            raise ValueError("at least one replica is needed")
        self.replicas = list(replicas)
        self._rng = random.Random(seed)

    def route(self, key: str, loads: Sequence[int]) -> int:
        return self._rng.randrange(len(self.replicas))


def least_loaded(waiting: Sequence[float], alive: Sequence[bool] | None = None) -> int:
    """Index of the live replica with the fewest waiting tokens (the lowest index on ties);
    ``waiting[i]``: tokens queued on replica ``i`` to compute (prefill not yet done)."""
    live = [i for i in range(len(waiting)) if alive is None or alive[i]]
    if not live:
        raise ValueError("no live replica")
    return min(live, key=lambda i: (waiting[i], i))


def spill_route(owner: int, waiting: Sequence[float], bound: float,
                alive: Sequence[bool] | None = None) -> int:
    """Replica for a turn whose conversation ``owner`` holds: the owner while its waiting
    tokens are at most ``bound`` (and it is alive), else :func:`least_loaded` when that one
    waits on fewer tokens than the owner (a spill: the turn's KV comes from a shared tier)."""
    if not bound >= 0:
        raise ValueError(f"bound must be >= 0, got {bound}")
    owner_up = alive is None or alive[owner]
    if owner_up and waiting[owner] <= bound:
        return owner
    best = least_loaded(waiting, alive)
    if owner_up and waiting[best] >= waiting[owner]:
        return owner
    return best


def spill_ranking(key: str, replicas: Sequence[str], waiting: Sequence[float], bound: float,
                  owner: int | None = None) -> list[int]:
    """Indices of ``replicas`` in the order to try for a turn with routing key ``key``:
    :func:`spill_route`'s choice first, then the rest in the key's rendezvous order.
    ``owner``: the replica of the key's last turn, when known; else the key's rendezvous
    first choice owns it. ``waiting[i]``: prompt tokens replica ``i`` has still to compute."""
    if len(waiting) != len(replicas):
        raise ValueError(f"{len(waiting)} waiting counts for {len(replicas)} replicas")
    order = preference(key, replicas)
    first = spill_route(order[0] if owner is None else owner, waiting, bound)
    return [first] + [i for i in order if i != first]
