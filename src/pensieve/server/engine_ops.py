"""What the server does to the engine's conversations, as functions of the engine.

Each runs where the engine lives (its thread, or its process with ``--engine-process``),
called through ``engine.call(fn, *args)``: module-level functions with plain arguments, so
that a call can be pickled to another process.
"""

from __future__ import annotations

import logging
from typing import Any

from pensieve.core.request import Request
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.scheduler import ConversationBusyError

log = logging.getLogger("pensieve.server")


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]: bisect with C-speed slice compares
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def rebase(eng: Any, cid: str, context: list[int]) -> list[int]:
    """The tokens to add after the conversation's history so that it becomes ``context``:
    the history is cut at its first token that differs (at least one token stays to add)."""
    history = eng.conversation_history(cid)
    keep = max(0, min(common_prefix_len(history, context), len(context) - 1))
    if keep < len(history):
        log.debug("conversation %s: history re-rendered from token %d of %d", cid, keep,
                  len(history))
        truncate_history(eng, cid, keep)
    return context[keep:]


def truncate_history(eng: Any, cid: str, num_tokens: int) -> None:
    """Cut an idle conversation's history to its first ``num_tokens`` tokens; the KV past
    them is freed (in both tiers) and the next turn computes what follows."""
    if cid in eng.scheduler.busy_conversations:
        raise ConversationBusyError(f"conversation {cid!r} has a turn running")
    conv = eng.cache.conversations.get(cid)
    if conv is None or num_tokens >= len(conv.token_ids):
        return
    conv.token_ids = conv.token_ids[:num_tokens]
    # What abandoning a turn does to an idle conversation (it reads nothing of the turn):
    # KV past the history goes, chunks wholly past it are freed, the eviction index rebuilt.
    eng.cache.abort_turn(_NO_TURN, conv, eng.now())


def set_history(eng: Any, cid: str, token_ids: list[int]) -> None:
    """Make an idle conversation's history ``token_ids``: the KV of its common prefix with the
    old history is kept, the rest is computed by the next turn."""
    conv = eng.cache.conversations.get(cid)
    if conv is None:
        return
    truncate_history(eng, cid, common_prefix_len(conv.token_ids, token_ids))
    conv.token_ids = list(token_ids)


_NO_TURN = Request("(history truncation)", [0], SamplingParams())


def set_hints(eng: Any, cid: str, priority: float | None, keep_alive_s: float | None,
              tenant: str | None = None) -> None:
    """A conversation's retention hints (``priority``, ``keep_alive_s`` of a request) and
    its tenant (whose share of each tier the hints count against)."""
    eng.set_conversation_hints(cid, priority, keep_alive_s, tenant)


def restore(eng: Any, cid: str, token_ids: list[int], priority: float | None,
            keep_alive_s: float | None, tenant: str | None = None) -> None:
    """Make the engine's history of the conversation the stored one (after a restart: the
    history, no KV; after another replica continued it: the KV of the common prefix kept)."""
    eng.restore_conversation(cid, token_ids)
    if eng.conversation_history(cid) != token_ids:
        set_history(eng, cid, token_ids)
    eng.set_conversation_hints(cid, priority, keep_alive_s, tenant)


def forget_if_empty(eng: Any, cid: str) -> None:
    """A new conversation whose first turn failed: nothing of it stays in the engine."""
    if not eng.conversation_history(cid):
        eng.delete_conversation(cid)


def stop_turn(eng: Any, rid: str, cid: str | None, history: list[int]) -> None:
    """End a turn at a stop string as if on a stop token (its KV kept), and make the history
    ``history``, the context plus the tokens up to the stop (tokens the engine sampled past
    it are cut, with their KV)."""
    eng.finish_request(rid)
    if cid is not None:
        set_history(eng, cid, history)


def drop_conversation(eng: Any, cid: str) -> None:
    """Delete an idle conversation and its KV (``DELETE /v1/conversations/{id}``)."""
    conv = eng.cache.conversations.get(cid)
    if conv is not None and conv.running:
        raise ConversationBusyError(f"conversation {cid!r} has a turn running")
    eng.delete_conversation(cid)


def waiting_tokens(eng: Any) -> int:
    """The prompt tokens the engine's turns still have to compute
    (:attr:`~pensieve.engine.engine_core.EngineCore.num_waiting_tokens`), counted now: the
    replicas' routing stats ask about once a second, between two steps."""
    return int(eng.num_waiting_tokens)
