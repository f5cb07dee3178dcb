"""The conversation store interface on SQLite (WAL, shared by processes) and PostgreSQL: the
same behaviour from both, and a conversation written by one store handle (one replica) is
read and continued by another; a turn written from a stale read is refused."""

from __future__ import annotations

import dataclasses
import sqlite3
import threading

import pytest

from pensieve.server.store_open import open_store
from pensieve.server.store_sqlite import ConversationStore, StaleTurnError, StoredConversation


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
    c2 = _next_turn(got, 2)
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


def _next_turn(conv: StoredConversation, n: int, key: str = "") -> StoredConversation:
    """``conv`` (as read) with its turns made ``n`` (as a server's next turn writes it)."""
    nxt = _conv(conv.id, conv.tenant, n=n)
    return dataclasses.replace(conv, messages=nxt.messages, token_ids=nxt.token_ids,
                               turns=nxt.turns, request_key=key)


def test_concurrent_writers(stores):
    """Two handles writing at once from threads: every turn lands."""
    a, b = stores
    errors = []

    def write(store, cid):
        try:
            conv = _conv(cid, n=1)
            store.save_turn(conv)
            for n in range(2, 21):
                conv = _next_turn(conv, n)
                store.save_turn(conv)
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


def test_stale_turn_never_replaces_a_newer_one(stores):
    """Two replicas start a turn of one conversation from the same read (e.g. one presumed
    dead that finished late): the first write lands, the second is refused, so the stored
    conversation keeps the turn the first wrote and its later ones. A new conversation's
    write is refused when its id exists; a deleted conversation is not written back."""
    a, b = stores
    a.save_turn(_conv("c1", n=1))
    read_a, read_b = a.get("c1"), b.get("c1")
    assert read_a is not None and read_b is not None and read_a.version == 1
    a.save_turn(_next_turn(read_a, 2, key="req-a"))
    after = a.get("c1")
    assert after is not None and after.version == 2
    a.save_turn(_next_turn(after, 3, key="req-a2"))
    late = _next_turn(read_b, 2, key="req-b")  # started from version 1
    with pytest.raises(StaleTurnError):
        b.save_turn(late)
    got = b.get("c1")
    assert got is not None and len(got.turns) == 3 and got.version == 3
    assert got.request_key == "req-a2"
    with pytest.raises(StaleTurnError):
        b.save_turn(_conv("c1", n=1))  # a new conversation under an existing id
    assert len(a.get("c1").turns) == 3
    assert a.delete("c1")
    with pytest.raises(StaleTurnError):
        b.save_turn(_next_turn(got, 4))
    assert a.get("c1") is None


def test_find_by_request(stores):
    """The conversation whose last turn a request key wrote, per tenant; a later turn with
    another key takes the lookup away."""
    a, b = stores
    c = _conv("c2")
    c.request_key = "k1"
    a.save_turn(c)
    assert b.find_by_request("public", "k1") == "c2"
    assert b.find_by_request("other", "k1") is None
    a.save_turn(_next_turn(c, 2, key="k2"))
    assert b.find_by_request("public", "k1") is None
    assert b.find_by_request("public", "k2") == "c2"


_OLD_TABLE = """CREATE TABLE conversations (id TEXT PRIMARY KEY, tenant TEXT NOT NULL,
    messages TEXT NOT NULL, token_ids TEXT NOT NULL, turns TEXT NOT NULL,
    messages_hash TEXT NOT NULL, priority REAL NOT NULL DEFAULT 1.0,
    keep_alive_s REAL NOT NULL DEFAULT 0.0, created REAL NOT NULL, updated REAL NOT NULL)"""
_OLD_ROW = """INSERT INTO conversations VALUES ('old', 'public', '[]', '[1, 2]',
    '[{"context_len": 1, "output_len": 1}]', 'h', 1.0, 0.0, 1.0, 1.0)"""


@pytest.fixture(params=["sqlite", "postgres"])
def old_store(request, tmp_path):
    """The target of a store made before ``request_key``/``version`` existed, one row in it."""
    if request.param == "sqlite":
        path = str(tmp_path / "old.db")
        db = sqlite3.connect(path)
        db.execute(_OLD_TABLE)
        db.execute(_OLD_ROW)
        db.commit()
        db.close()
        yield path
        return
    import psycopg
    from pg_server import fresh_database

    with fresh_database(request.getfixturevalue("pg_url")) as url:
        with psycopg.connect(url, autocommit=True) as db:
            db.execute(_OLD_TABLE)
            db.execute(_OLD_ROW)
        yield url


def test_table_of_an_older_version_gains_the_columns(old_store):
    """An older store opens (twice: two replicas): its rows read as version 1 and take their
    next turn."""
    store, again = open_store(old_store), open_store(old_store)
    try:
        got = store.get("old")
        assert got is not None and got.version == 1 and got.request_key == ""
        store.save_turn(_next_turn(got, 2, key="k"))
        assert again.find_by_request("public", "k") == "old"
        assert again.get("old").version == 2
    finally:
        store.close()
        again.close()


def test_an_edited_row_is_refused_and_named_at_open(stores):
    """A conversation edited in the database (its text, outside the server) fails its
    checksum on both backends: every read refuses it, and the check at open lists it."""
    from pensieve.server.store_check import open_checked
    from pensieve.server.store_sqlite import CorruptConversationError

    a, b = stores
    a.save_turn(_conv("c1", n=2))
    a.save_turn(_conv("c2", n=1))
    sql = "UPDATE conversations SET messages = replace(messages, 'a1', 'b1') WHERE id = 'c1'"
    if isinstance(a, ConversationStore):
        raw = sqlite3.connect(a.path)
        raw.execute(sql)
        raw.commit()
        raw.close()
    else:
        import psycopg

        with psycopg.connect(a.path, autocommit=True) as raw:
            raw.execute(sql)
    with pytest.raises(CorruptConversationError, match="'c1' is corrupt.*checksum mismatch"):
        b.get("c1")
    assert b.get("c2").messages == _conv("c2").messages
    store, report = open_checked(a.path)
    try:
        assert "c1" in report.corrupt and "c2" not in report.corrupt
    finally:
        store.close()


def _open_at_once(path: str, barrier, results) -> None:  # type: ignore[no-untyped-def]
    barrier.wait()
    try:
        ConversationStore(path).close()
        results.put("ok")
    except Exception as e:  # noqa: BLE001 - reported to the test
        results.put(f"{type(e).__name__}: {e}")


def test_replicas_open_a_new_sqlite_store_at_once(tmp_path):
    """Three processes open one new SQLite store at the same moment, as replicas started
    together do: each opens it (switching a new file to WAL used to fail at once with
    "database is locked" in one of them, a third of the time)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    for run in range(10):
        path = str(tmp_path / f"conv{run}.db")
        barrier, results = ctx.Barrier(3), ctx.Queue()
        procs = [ctx.Process(target=_open_at_once, args=(path, barrier, results))
                 for _ in range(3)]
        for p in procs:
            p.start()
        got = [results.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        assert got == ["ok"] * 3, (run, got)
