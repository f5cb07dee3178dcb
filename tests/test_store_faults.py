"""A conversation store damaged in twelve ways: each gives a clear refusal to open
(:class:`StoreOpenError`, before the engine starts) or a clear per-conversation error, and
never a conversation whose history differs from what was written.

The ways: half-truncated, garbage header, garbage mid-file, not a database, edited text,
edited role, edited token ids, garbage in the write-ahead log, read-only file, read-only
directory, unwritable path, full disk (an injected ``OperationalError``) at open. The full
disk while serving is in ``test_store_write_failures.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from pensieve.server.store_check import StoreOpenError, open_checked, wal_damage
from pensieve.server.store_sqlite import (
    ConversationStore,
    CorruptConversationError,
    StoredConversation,
    StoreWriteError,
)

N = 23


def _conv(i: int) -> StoredConversation:
    text = "Paris." if i == 7 else f"answer {i}"
    return StoredConversation(f"c{i:02d}", "public",
                              [{"role": "user", "content": f"question {i}"},
                               {"role": "assistant", "content": text}],
                              [1000 + i, 2, 3, 4 + i], [{"context_len": 3, "output_len": 1}])


def _fill(path: Path) -> dict[str, StoredConversation]:
    store = ConversationStore(str(path))
    convs = {}
    for i in range(N):
        c = _conv(i)
        store.save_turn(c)
        convs[c.id] = _conv(i)
    store.close()
    return convs


def _served_as_written(store: object, convs: dict[str, StoredConversation]) -> list[str]:
    """Every conversation reads back exactly as written or is refused; the refused ids."""
    refused = []
    for cid, want in convs.items():
        try:
            got = store.get(cid)  # type: ignore[attr-defined]
        except CorruptConversationError as e:
            assert cid in e.message and e.code == "conversation_corrupt"
            refused.append(cid)
            continue
        if got is None:  # a row lost to damage is missing, never altered
            refused.append(cid)
            continue
        assert (got.messages, got.token_ids, got.turns) == (want.messages, want.token_ids,
                                                             want.turns)
    return refused


def _edit(path: Path, old: bytes, new: bytes) -> None:
    data = path.read_bytes()
    assert data.count(old) >= 1
    path.write_bytes(data.replace(old, new, 1))


@pytest.fixture
def db(tmp_path: Path) -> tuple[Path, dict[str, StoredConversation]]:
    path = tmp_path / "conv.db"
    return path, _fill(path)


@pytest.mark.parametrize("damage", ["truncated", "garbage-header", "not-a-database"])
def test_a_store_that_is_not_one_refuses_to_open(damage: str, db: tuple[Path, dict]) -> None:
    path, _ = db
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[:len(data) // 2])
    elif damage == "garbage-header":
        path.write_bytes(os.urandom(100) + data[100:])
    else:
        path.write_text("this is a text file, not a database\n" * 200)
    with pytest.raises(StoreOpenError, match=r"cannot open the conversation store .*conv\.db"):
        open_checked(str(path))


@pytest.mark.parametrize("edit", ["text", "role", "token-ids"])
def test_an_edited_conversation_is_refused_and_the_others_served(
        edit: str, db: tuple[Path, dict], caplog: pytest.LogCaptureFixture) -> None:
    """"Paris." edited to "Xaris.", a role "user" to "uzer", a token id changed, inside the
    file: the store opens, names the conversation, refuses it and serves the other 22."""
    path, convs = db
    old, new = {"text": (b"Paris.", b"Xaris."),
                "role": (b'"role": "user", "content": "question 11"',
                         b'"role": "uzer", "content": "question 11"'),
                "token-ids": (b"[1019, 2, 3, 23]", b"[1019, 2, 3, 24]")}[edit]
    _edit(path, old, new)
    with caplog.at_level("INFO", logger="pensieve.server"):
        store, report = open_checked(str(path))
    try:
        bad = {"text": "c07", "role": "c11", "token-ids": "c19"}[edit]
        assert report.corrupt == [bad]
        assert f"1 conversation(s) are corrupt and will be refused: {bad}" in caplog.text
        assert "quick_check ok" in caplog.text
        assert _served_as_written(store, convs) == [bad]
    finally:
        store.close()


def test_garbage_mid_file_never_serves_altered_history(db: tuple[Path, dict]) -> None:
    """4 KB of garbage in the middle of the file: it refuses to open, or opens with the
    damage logged and serves each conversation as written or refuses it."""
    path, convs = db
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 4096] = os.urandom(4096)
    path.write_bytes(bytes(data))
    try:
        store, report = open_checked(str(path))
    except StoreOpenError as e:
        assert "conv.db" in str(e)
        return
    try:
        assert report.quick_check or report.corrupt
        _served_as_written(store, convs)
    finally:
        store.close()


def _crash_copy(src: Path, dst: Path) -> None:
    """``dst``: the files of a store whose process died with its turns still in the log."""
    store = ConversationStore(str(src))
    for i in range(N):
        store.save_turn(_conv(i))
    shutil.copy(src, dst)
    shutil.copy(str(src) + "-wal", str(dst) + "-wal")
    store.close()


def test_a_damaged_write_ahead_log_refuses_to_open(tmp_path: Path) -> None:
    """8 KB of garbage in the middle of the -wal file: SQLite would drop every turn after
    it without a word; the store refuses to open and says how to go on. The log of a crash
    without damage opens with all its turns."""
    intact = tmp_path / "intact.db"
    _crash_copy(tmp_path / "live.db", intact)
    wal = Path(str(intact) + "-wal")
    assert wal.stat().st_size > 20_000 and wal_damage(str(intact)) is None
    broken = tmp_path / "broken.db"
    shutil.copy(intact, broken)
    data = bytearray(wal.read_bytes())
    mid = len(data) // 3
    data[mid:mid + 8192] = os.urandom(8192)
    Path(str(broken) + "-wal").write_bytes(bytes(data))
    with pytest.raises(StoreOpenError, match="write-ahead log is damaged.*move the -wal"):
        open_checked(str(broken))
    store, report = open_checked(str(intact))
    try:
        assert store.count() == N and not report.corrupt
    finally:
        store.close()


def test_a_write_ahead_log_with_a_garbage_header_refuses_to_open(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    _crash_copy(tmp_path / "live.db", path)
    wal = Path(str(path) + "-wal")
    wal.write_bytes(os.urandom(32) + wal.read_bytes()[32:])
    with pytest.raises(StoreOpenError, match="write-ahead log is damaged"):
        open_checked(str(path))


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory an unprivileged user can reach (pytest's are private to their owner)."""
    d = Path(tempfile.mkdtemp(prefix="pensieve-ro-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        for p in [d, *d.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        shutil.rmtree(d)


NOBODY = 65534

_OPEN = """
import ctypes, os, sys
from pensieve.server.store_check import open_checked, StoreOpenError
if os.geteuid() == 0:  # file modes do not stop root: reach files as nobody (this thread)
    libc = ctypes.CDLL(None)
    libc.setfsgid(NOBODY)
    libc.setfsuid(NOBODY)
try:
    open_checked(sys.argv[1])
except StoreOpenError as e:
    print(e)
    sys.exit(2)
""".replace("NOBODY", str(NOBODY))


def _open_unprivileged(target: str) -> subprocess.CompletedProcess[str]:
    """Open the store in a process of its own, whose file accesses are checked as
    ``nobody``'s when this runs as root."""
    return subprocess.run([sys.executable, "-c", _OPEN, target], capture_output=True,
                          text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


@pytest.mark.parametrize("where", ["read-only file", "read-only directory"])
def test_a_read_only_store_refuses_to_open(where: str, shared_dir: Path) -> None:
    path = shared_dir / "conv.db"
    _fill(path)
    if os.geteuid() == 0:
        for p in (shared_dir, *shared_dir.iterdir()):
            os.chown(p, NOBODY, NOBODY)
    if where == "read-only file":
        path.chmod(0o444)
    else:
        path.chmod(0o644)
        shared_dir.chmod(0o555)
    r = _open_unprivileged(str(path))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "conv.db" in r.stdout and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "attempt to write a readonly database" in r.stdout, r.stdout


def test_an_unwritable_path_refuses_to_open(shared_dir: Path) -> None:
    shared_dir.chmod(0o555)
    if os.geteuid() == 0:
        os.chown(shared_dir, 0, 0)
    r = _open_unprivileged(str(shared_dir / "sub" / "conv.db"))
    assert r.returncode == 2 and "directory" in r.stdout, r.stdout + r.stderr
    with pytest.raises(StoreOpenError, match="cannot create the store's directory"):
        open_checked("/proc/pensieve-nowhere/conv.db")


class FullDisk:
    """A connection whose writes fail as on a full disk while ``full`` is set."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db, self.full = db, True

    def execute(self, sql: str, *args: object) -> sqlite3.Cursor:
        if self.full and sql.lstrip().split()[0].upper() in ("INSERT", "UPDATE", "DELETE"):
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, *args)

    def __getattr__(self, name: str) -> object:
        return getattr(self.db, name)


def test_a_full_disk_at_open_refuses_to_open(db: tuple[Path, dict],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = db
    real = ConversationStore.probe

    def probe(self: ConversationStore) -> None:
        self._db = FullDisk(self._db)  # type: ignore[assignment]
        real(self)

    monkeypatch.setattr(ConversationStore, "probe", probe)
    with pytest.raises(StoreOpenError, match="takes no writes.*disk is full"):
        open_checked(str(path))


def test_a_failed_write_is_a_store_write_error(db: tuple[Path, dict]) -> None:
    path, convs = db
    store = ConversationStore(str(path))
    try:
        store._db = FullDisk(store._db)  # type: ignore[assignment]
        conv = store.get("c03")
        assert conv is not None
        conv.token_ids = conv.token_ids + [9]
        with pytest.raises(StoreWriteError, match="disk is full"):
            store.save_turn(conv)
        store._db.full = False  # type: ignore[attr-defined]
        assert store.get("c03").token_ids == convs["c03"].token_ids  # type: ignore[union-attr]
        store.save_turn(conv)
        assert store.get("c03").token_ids == convs["c03"].token_ids + [9]  # type: ignore
    finally:
        store.close()


def test_rows_of_a_store_without_checksums_are_stamped_at_open(db: tuple[Path, dict]) -> None:
    """A store written before checksums existed: its rows are trusted as they are at open
    and stamped, then verified like the others."""
    path, convs = db
    raw = sqlite3.connect(path)
    raw.execute("UPDATE conversations SET checksum = ''")
    raw.commit()
    raw.close()
    store, report = open_checked(str(path))
    try:
        assert not report.corrupt and _served_as_written(store, convs) == []
    finally:
        store.close()
    raw = sqlite3.connect(path)
    assert raw.execute("SELECT COUNT(*) FROM conversations WHERE checksum = ''").fetchone() == (0,)
    raw.execute("UPDATE conversations SET messages = ? WHERE id = 'c02'",
                (json.dumps([{"role": "user", "content": "edited"}]),))
    raw.commit()
    raw.close()
    store, report = open_checked(str(path))
    try:
        assert report.corrupt == ["c02"]
    finally:
        store.close()


class Locked:
    """A connection whose reads fail as when another process holds the file past the busy
    timeout."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def execute(self, sql: str, *args: object) -> sqlite3.Cursor:
        if sql.lstrip().upper().startswith("SELECT"):
            raise sqlite3.OperationalError("database is locked")
        return self.db.execute(sql, *args)

    def __getattr__(self, name: str) -> object:
        return getattr(self.db, name)


def test_a_read_that_fails_is_the_store_unavailable_not_a_corrupt_conversation(
        db: tuple[Path, dict]) -> None:
    path, _ = db
    store = ConversationStore(str(path))
    try:
        store._db = Locked(store._db)  # type: ignore[assignment]
        with pytest.raises(StoreWriteError, match="cannot read.*locked") as e:
            store.get("c01")
        assert e.value.status == 503 and e.value.code == "store_unavailable"
    finally:
        store.close()
