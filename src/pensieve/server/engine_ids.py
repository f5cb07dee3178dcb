"""Which engine conversation holds an API conversation's KV.

A request without a conversation id that re-sends a stored history starts a *new*
conversation: matching a history is a cache hit, not an identity. Two users of one API key
who each sent "Hi!" hold two stored conversations with equal messages; when both re-send that
history with their own questions at once, neither may join the other's conversation (the
question would show in the other's ``GET``) nor wait for it (a 409).

The KV is shared, the conversation is not. The new conversation *takes over* the engine
conversation that holds the matched history, so a client that re-sends its whole history
each turn computes only its new tokens, from whichever tier the KV is in. The matched
conversation keeps its stored row; should it be continued by its id, it gets an engine
conversation of its own (a fresh engine id: its history restored from the store, its full
chunks shared on the GPU where the taker still holds them)::

    stored    conv-A [Hi, ans]            conv-B [Hi, ans, Q, ans2]    (B matched A's history)
    engine    conv-A~1 (not made yet)     conv-A [Hi ans Q ans2]       (B took A's over)

Only one request can take an engine conversation over: the take-over happens on the event
loop with no wait between reading the map and writing it, and the matched conversation
points to a fresh engine id from then on. An engine conversation busy with a turn by its own
id is not taken (the engine refuses it): the new conversation then starts an engine
conversation of its own (:meth:`EngineIds.give_back`). The map is in memory, like the
engine's KV: after a restart every id is its own engine id again. It holds at most
:data:`MAX_ENTRIES` entries, the least recently used dropped first (a conversation whose
entry went computes its history again).
"""

from __future__ import annotations

import secrets
from collections import OrderedDict

MAX_ENTRIES = 1 << 18
"""Entries kept (two per take-over: ~40 MB at most)."""


class EngineIds:
    """API conversation id -> engine conversation id (itself unless taken over)."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self._of: OrderedDict[str, str] = OrderedDict()
        self._taken: OrderedDict[str, tuple[str, str, str]] = OrderedDict()
        """Taker -> (the matched conversation, its engine id before, its fresh one)."""
        self.max_entries = max_entries

    def of(self, cid: str) -> str:
        """The engine conversation of ``cid``."""
        eid = self._of.get(cid)
        if eid is None:
            return cid
        self._of.move_to_end(cid)
        return eid

    def take_over(self, matched: str, taker: str) -> str:
        """``taker`` (a new conversation) takes over ``matched``'s engine conversation, whose
        id it returns; ``matched`` gets a fresh one."""
        eid = self.of(matched)
        fresh = f"{matched}~{secrets.token_hex(4)}"
        self._set(taker, eid)
        self._set(matched, fresh)
        self._taken[taker] = (matched, eid, fresh)
        while len(self._taken) > self.max_entries:
            self._taken.popitem(last=False)
        return eid

    def give_back(self, taker: str) -> bool:
        """Undo ``taker``'s take-over (its turn was refused, failed, or could not be stored):
        the matched conversation gets its engine conversation back unless either moved on
        since; ``taker`` is its own engine id again. False when ``taker`` took nothing over."""
        entry = self._taken.pop(taker, None)
        if entry is None:
            return False
        matched, eid, fresh = entry
        held = self._of.pop(taker, taker) == eid  # not taken over from it in turn since
        if held and self._of.get(matched) == fresh:
            self._set(matched, eid)
        return True

    def settle(self, taker: str) -> None:
        """``taker``'s first turn is stored: its take-over stands."""
        self._taken.pop(taker, None)

    def forget(self, cid: str) -> None:
        """``cid`` is deleted."""
        self._of.pop(cid, None)
        self._taken.pop(cid, None)

    def _set(self, cid: str, eid: str) -> None:
        if eid == cid:
            self._of.pop(cid, None)
            return
        self._of[cid] = eid
        self._of.move_to_end(cid)
        while len(self._of) > self.max_entries:
            self._of.popitem(last=False)
