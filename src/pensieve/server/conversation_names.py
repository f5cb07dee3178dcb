"""Conversation ids that clients choose, scoped to their tenant.

The server's own ids are ``conv-`` and 24 unguessable characters. A client may instead name a
conversation (``conversation_id``, ``X-Conversation-Id`` or ``X-Session-ID``, as vLLM's
multi-turn benchmark with ``--send-conversation-id`` does): the name's first turn starts it,
later turns continue it. A name is stored under ``conv-`` and a hash of the tenant and the
name, so two API keys using the same name hold two conversations, neither able to reach the
other's (ids are scoped to the tenant, as the server's own are). A name that starts with
``conv-`` is taken as a server id (unknown: a 404).
"""

from __future__ import annotations

import hashlib

from pensieve.server.state import ServerState
from pensieve.server.turns import off_loop


def stored_id(tenant: str, cid: str) -> str:
    """The id a request's conversation id stands for in the store."""
    if cid.startswith("conv-"):
        return cid
    digest = hashlib.sha256(f"{tenant}\0{cid}".encode()).hexdigest()[:40]
    return "conv-n" + digest


async def resolve(state: ServerState, tenant: str, cid: str | None
                  ) -> tuple[str | None, str | None]:
    """(the conversation to continue, the id of a new one to start): a server id or a known
    name continues; an unknown name starts its conversation."""
    if cid is None:
        return None, None
    sid = stored_id(tenant, cid)
    if sid == cid:
        return cid, None
    conv = await off_loop(state, lambda: state.store.get(sid))
    return (sid, None) if conv is not None else (None, sid)
