"""The conversation store interface on SQLite (WAL, shared by processes) and PostgreSQL: the
same behaviour from both, and a conversation written by one store handle (one replica) is
read and continued by another."""

from __future__ import annotations

import threading

import pytest

from pensieve.server.store import ConversationStore, StoredConversation
from pensieve.server.stores import open_store


@pytest.fixture(scope="module")
def pg_url():
    pytest.importorskip("psycopg", reason="the replicas extra is not installed")
    from pg_server import postgres_url

    with postgres_url() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgres"])
def stores(request, tmp_path):
    """Two handles on one store, as two replicas hold them."""
    if request.param == "sqlite":
        target = str(tmp_path / "sub" / "conv.db")
    else:
        target = request.getfixturevalue("pg_url")
    a, b = open_store(target), open_store(target)
    for cid in ("c1", "c2", "c3"):
        a.delete(cid)
    yield a, b
    a.close()
    b.close()


def _conv(cid: str, tenant: str = "public", n: int = 1) -> StoredConversation:
    msgs = []
    for i in range(n):
        msgs += [{"role": "user", "content": f"q{i} é"}, {"role": "assistant", "content": f"a{i}"}]
    return StoredConversation(cid, tenant, msgs, list(range(10 * n)),
                              [{"context_len": 5, "output_len": 5}] * n)


def test_open_store_picks_the_backend(tmp_path):
    s = open_store(str(tmp_path / "x" / "y.db"))
    assert isinstance(s, ConversationStore)
    s.close()


def test_round_trip_and_lookup(stores):
    a, b = stores
    base = b.count()
    c = _conv("c1", n=1)
    a.save_turn(c)
    got = b.get("c1")
    assert got is not None
    assert (got.messages, got.token_ids, got.turns) == (c.messages, c.token_ids, c.turns)
    assert got.created > 0 and got.updated >= got.created
    assert b.find_by_messages("public", c.messages) == "c1"
    assert b.find_by_messages("other", c.messages) is None
    assert b.find_by_messages("public", c.messages[:1]) is None
    # the next turn, written by the other handle (the conversation moved replicas)
    c2 = _conv("c1", n=2)
    c2.created = got.created
    b.save_turn(c2)
    got = a.get("c1")
    assert got is not None and got.token_ids == list(range(20)) and len(got.turns) == 2
    assert a.find_by_messages("public", c.messages) is None  # only the latest messages match
    assert a.find_by_messages("public", c2.messages) == "c1"
    assert a.count() == base + 1
    a.set_hints("c1", 2.0, 30.0)
    got = b.get("c1")
    assert got is not None and (got.priority, got.keep_alive_s) == (2.0, 30.0)
    assert b.delete("c1") and not a.delete("c1")
    assert a.get("c1") is None and a.count() == base
    assert b.get("missing") is None


def test_concurrent_writers(stores):
    """Two handles writing at once from threads: every turn lands."""
    a, b = stores
    errors = []

    def write(store, cid):
        try:
            for n in range(1, 21):
                store.save_turn(_conv(cid, n=n))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=write, args=(a, "c2")),
          threading.Thread(target=write, args=(b, "c3"))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors
    for cid in ("c2", "c3"):
        got = a.get(cid)
        assert got is not None and len(got.turns) == 20
