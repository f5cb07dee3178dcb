"""The ``return`` eviction policy: recompute saved times the chance the conversation returns."""

from __future__ import annotations

import math

from pensieve.core.conversation import Conversation
from pensieve.core.eviction import ReturnPolicy, get_policy


def cost(context_len: int) -> float:
    return 1e-4 + 1e-7 * context_len  # grows with the context, as attention does


def conv(cid: str, kv_end: int, last_active: float) -> Conversation:
    return Conversation(cid, kv_end=kv_end, last_active=last_active)


def test_key_falls_while_idle_and_grows_along_the_conversation() -> None:
    p = get_policy("return")
    c = conv("a", 64_000, last_active=0.0)
    keys = [p.key(c, 100, t, cost, 32)[0] for t in (0.0, 0.5, 3.0, 10.0, 60.0, 600.0)]
    assert all(a > b for a, b in zip(keys, keys[1:]))  # lower bounds stay valid in the index
    along = [p.key(c, i, 5.0, cost, 32)[0] for i in (0, 10, 500, 1999)]
    assert all(a < b for a, b in zip(along, along[1:]))  # leading chunks first
    # just finished: the recompute saved times P(return) = continue_p
    assert math.isclose(p.key(c, 0, 0.0, cost, 32)[0], 0.9 * cost(32))


def test_an_ended_long_history_goes_before_a_live_short_one() -> None:
    """A 100k-token session idle 60 s (with 6 s think times: almost surely over) against a
    2k-token chat idle 3 s: pensieve's Cost / idle keeps the long one, ``return`` drops it."""
    long_idle = conv("agent", 100_000, last_active=0.0)
    short_live = conv("chat", 2_000, last_active=57.0)
    now = 60.0
    tail_long, tail_short = 100_000 // 32 - 1, 2_000 // 32 - 1
    pen = get_policy("pensieve")
    assert pen.key(long_idle, tail_long, now, cost, 32) > pen.key(short_live, tail_short, now,
                                                                   cost, 32)
    ret = ReturnPolicy()
    assert ret.key(long_idle, tail_long, now, cost, 32) < ret.key(short_live, tail_short, now,
                                                                  cost, 32)


def test_queued_conversations_keep_the_queue_floor() -> None:
    c = conv("q", 4_000, last_active=0.0)
    c.queued_at = 5.0
    assert get_policy("return").key(c, 3, 100.0, cost, 32) == \
        get_policy("pensieve").key(c, 3, 100.0, cost, 32)
