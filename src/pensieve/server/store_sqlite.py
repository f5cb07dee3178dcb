"""Persistent conversation store: one interface (:class:`Store`), SQLite in WAL mode here,
PostgreSQL in :mod:`.store_pg`; :func:`pensieve.server.store_open.open_store` picks one from a
path or a URL.

Replicas on one host share one SQLite file (WAL lets readers run beside the one writer; a
writer waits up to ``busy_timeout`` for another); replicas on several hosts share a
PostgreSQL database. Either way any replica can continue any conversation from the store.

One row per conversation: owner (tenant), messages (JSON), the raw token history (every input
and output token, the engine's ``Conversation.token_ids``), per-turn boundaries, retention
hints, and a hash of the message list for recognising a client that re-sends the whole history.
A row is written when a turn completes, before the client sees the end of the answer, so a
completed turn survives a crash of the server. Dropped KV is recomputed from ``token_ids``.

Each write is conditional: a turn's row is written only if the row still has the ``version``
the turn read (a new conversation: only if no row has its id), else :class:`StaleTurnError`.
So a turn that started from an older state (a replica that was presumed dead and finished
late, or two replicas running turns of one conversation at once) can never replace a newer
turn with a shorter history. The row also names the request that wrote its last turn
(``request_key``: the replicas' ingress gives each request one, the same on its retries), so a
retry whose first replica stored the turn and died before answering redoes that turn
(:mod:`pensieve.server.turns`) instead of starting a second conversation without it.

Integrity. Each turn's write stamps the row with a ``checksum`` (SHA-256 over its id, tenant,
messages (roles and text), token ids and turn boundaries: :func:`row_checksum`). Every read
verifies it: a row edited outside the server, or on a damaged page, is never fed to the model
but refused with :class:`CorruptConversationError` (a 500 naming the conversation) while the
other conversations are served. Rows of a store made before checksums existed are stamped
when the store is opened (their content is trusted as it is then). A write that fails (disk
full, read-only file) raises :class:`StoreWriteError`; :mod:`.store_check` checks a store
before the server starts (quick_check, the write-ahead log, a write probe, every row).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from pensieve.server.errors import APIError


def schema(real: str = "REAL") -> str:
    """The conversations table and its hash index; ``real``: the dialect's float type
    (PostgreSQL's store passes ``DOUBLE PRECISION``)."""
    return f"""
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    messages TEXT NOT NULL,
    token_ids TEXT NOT NULL,
    turns TEXT NOT NULL,
    messages_hash TEXT NOT NULL,
    priority {real} NOT NULL DEFAULT 1.0,
    keep_alive_s {real} NOT NULL DEFAULT 0.0,
    created {real} NOT NULL,
    updated {real} NOT NULL,
    request_key TEXT NOT NULL DEFAULT '',
    version INTEGER NOT NULL DEFAULT 1,
    checksum TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS by_hash ON conversations (tenant, messages_hash);
CREATE TABLE IF NOT EXISTS pensieve_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


ADDED_COLUMNS = (("request_key", "TEXT NOT NULL DEFAULT ''"),
                 ("version", "INTEGER NOT NULL DEFAULT 1"),
                 ("checksum", "TEXT NOT NULL DEFAULT ''"))
"""Columns a table made by an older version lacks, added when a store opens it (its rows get
version 1: written once; their checksums are stamped by :func:`unstamped` and
:func:`stamp_statement`)."""

PROBE = ("INSERT INTO pensieve_meta (key, value) VALUES ('probe', {ph}) "
         "ON CONFLICT (key) DO UPDATE SET value = excluded.value")
"""A write that proves the store takes writes (at open, and from ``/health`` while a turn's
write has failed)."""

REQUEST_INDEX = ("CREATE INDEX IF NOT EXISTS by_request "
                 "ON conversations (tenant, request_key)")


class CorruptConversationError(APIError):
    """A stored conversation that does not match its checksum, or cannot be read: refused
    (a 500, ``conversation_corrupt``), never fed to the model. ``tenant``: the row's owner
    as stored ("" when unreadable), so that another tenant still sees a 404."""

    def __init__(self, conversation_id: str, why: str, tenant: str = "") -> None:
        super().__init__(500, f"conversation {conversation_id!r} is corrupt in the store "
                         f"({why}): it is not served; delete it or restore the store from a "
                         "backup", "server_error", code="conversation_corrupt")
        self.conversation_id, self.tenant = conversation_id, tenant


class StoreWriteError(APIError):
    """The store refused a write (disk full, read-only file or mount, a lost database): the
    turn was answered but not stored (a 503, ``store_unavailable``). With ``action="read"``:
    a read that failed for a reason other than damage (locked past the busy timeout, an I/O
    error)."""

    def __init__(self, error: BaseException, action: str = "write") -> None:
        super().__init__(503, f"the conversation store cannot {action}: "
                         f"{type(error).__name__}: {error}", "server_error",
                         code="store_unavailable")


class StaleTurnError(APIError):
    """A turn's write found its conversation changed since the turn read it (another turn was
    written, or the conversation deleted): the write is refused, and the request answered
    with a 409 (``conversation_conflict``)."""

    def __init__(self, message: str) -> None:
        super().__init__(409, message, code="conversation_conflict")


_SCHEMA = schema()


def messages_hash(tenant: str, messages: list[dict[str, Any]]) -> str:
    """Stable hash of a tenant's message list (role and content only)."""
    canon = json.dumps([[m.get("role"), m.get("content")] for m in messages],
                       ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(f"{tenant}\x00{canon}".encode()).hexdigest()


@dataclass
class StoredConversation:
    id: str
    tenant: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    turns: list[dict[str, int]] = field(default_factory=list)
    """Per completed turn: ``context_len`` (tokens before the answer) and ``output_len``."""
    priority: float = 1.0
    keep_alive_s: float = 0.0
    created: float = 0.0
    updated: float = 0.0
    request_key: str = ""
    """The request that wrote (or, in memory, writes) the last turn; "" when none was given."""
    version: int = 0
    """The row's version when read (0: not stored yet); a write succeeds only while the row
    still has it, and makes it one more."""


COLUMNS = ("id", "tenant", "messages", "token_ids", "turns", "messages_hash", "priority",
           "keep_alive_s", "created", "updated", "request_key", "version", "checksum")
"""A row's columns, in the order of :func:`row_values` (shared by both stores)."""


def row_checksum(cid: str, tenant: str, messages: Any, token_ids: Any, turns: Any) -> str:
    """SHA-256 of what a turn feeds the model: the conversation's id and owner, its messages
    (roles and text), token ids and turn boundaries, as canonical JSON."""
    canon = json.dumps([cid, tenant, messages, token_ids, turns], ensure_ascii=False,
                       separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(canon.encode("utf-8", "surrogatepass")).hexdigest()


def row_values(conv: StoredConversation) -> tuple[Any, ...]:
    """The row ``conv``'s next write puts (version one more), in :data:`COLUMNS` order (JSON
    text for the lists)."""
    return (conv.id, conv.tenant, json.dumps(conv.messages, ensure_ascii=False),
            json.dumps(conv.token_ids), json.dumps(conv.turns),
            messages_hash(conv.tenant, conv.messages), conv.priority, conv.keep_alive_s,
            conv.created, conv.updated, conv.request_key, conv.version + 1,
            row_checksum(conv.id, conv.tenant, conv.messages, conv.token_ids, conv.turns))


def from_row(row: tuple[Any, ...], cid: str = "?") -> StoredConversation:
    """A conversation from a row of :data:`COLUMNS` without ``messages_hash``, its checksum
    verified (else :class:`CorruptConversationError`; ``cid``: the id asked for)."""
    tenant = row[1] if isinstance(row[1], str) else ""
    try:
        messages, token_ids, turns = json.loads(row[2]), json.loads(row[3]), json.loads(row[4])
        conv = StoredConversation(row[0], row[1], messages, token_ids, turns, float(row[5]),
                                  float(row[6]), float(row[7]), float(row[8]), str(row[9]),
                                  int(row[10]))
    except (TypeError, ValueError) as e:
        raise CorruptConversationError(cid, f"unreadable row: {e}", tenant) from e
    if row[0] != cid and cid != "?":
        raise CorruptConversationError(cid, f"the row holds id {row[0]!r}", tenant)
    if row[11] != row_checksum(row[0], row[1], messages, token_ids, turns):
        raise CorruptConversationError(cid, "checksum mismatch", tenant)
    return conv


SELECT_COLUMNS = ", ".join(c for c in COLUMNS if c != "messages_hash")
"""A row's columns as :func:`from_row` reads them."""


def unstamped(ph: str) -> str:
    """The rows without a checksum (written before checksums existed)."""
    return f"SELECT id, tenant, messages, token_ids, turns FROM conversations WHERE checksum = {ph}"


def stamp_statement(row: tuple[Any, ...], ph: str) -> tuple[str, tuple[Any, ...]]:
    """The update that gives a row of :func:`unstamped` its checksum."""
    cid, tenant, messages, token_ids, turns = row
    total = row_checksum(cid, tenant, json.loads(messages), json.loads(token_ids),
                         json.loads(turns))
    return (f"UPDATE conversations SET checksum = {ph} WHERE id = {ph} AND checksum = {ph}",
            (total, cid, ""))


def write_statement(conv: StoredConversation, ph: str) -> tuple[str, tuple[Any, ...]]:
    """The conditional write of ``conv``'s row (``ph``: the driver's placeholder): an insert
    that does nothing if the id exists (a new conversation), else an update of the row only
    at the version ``conv`` was read at. Either changes one row, or none when stale."""
    row = row_values(conv)
    if conv.version == 0:
        return (f"INSERT INTO conversations ({', '.join(COLUMNS)}) VALUES "
                f"({', '.join([ph] * len(COLUMNS))}) ON CONFLICT (id) DO NOTHING", row)
    sets = ", ".join(f"{c} = {ph}" for c in COLUMNS[1:])
    return (f"UPDATE conversations SET {sets} WHERE id = {ph} AND version = {ph}",
            row[1:] + (conv.id, conv.version))


def stamp(conv: StoredConversation) -> None:
    """Set ``conv``'s write times (``created`` only on its first write)."""
    conv.updated = time.time()
    if not conv.created:
        conv.created = conv.updated


def written(conv: StoredConversation, rows: int) -> None:
    """After ``conv``'s write changed ``rows`` rows: its new version, or the stale error."""
    if rows != 1:
        raise StaleTurnError(f"conversation {conv.id!r} changed since this turn read it "
                             f"(version {conv.version}): the turn is not stored")
    conv.version += 1


class Store(Protocol):
    """What the server needs of a conversation store (every method thread-safe)."""

    def get(self, conversation_id: str) -> StoredConversation | None: ...

    def find_by_messages(self, tenant: str, messages: list[dict[str, Any]]) -> str | None: ...

    def find_by_request(self, tenant: str, request_key: str) -> str | None: ...

    def save_turn(self, conv: StoredConversation) -> None: ...

    def set_hints(self, conversation_id: str, priority: float, keep_alive_s: float) -> None: ...

    def delete(self, conversation_id: str) -> bool: ...

    def count(self) -> int: ...

    def ids(self) -> list[str]: ...

    def probe(self) -> None: ...

    def close(self) -> None: ...


def _to_wal(db: sqlite3.Connection, timeout_s: float) -> None:
    """Put the file in WAL mode. The switch needs the file to itself: while another process
    opens a new store (replicas started together), SQLite answers "database is locked" at
    once instead of waiting out ``busy_timeout`` (one replica of two failed to start that
    way in 11 of 30 tries), so the switch is tried again until then."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


class ConversationStore:
    """The SQLite store: thread-safe access to one file (one connection, one lock per
    process; several processes may share the file). A write that fails raises
    :class:`StoreWriteError`; a row that fails its checksum or cannot be read,
    :class:`CorruptConversationError`."""

    def __init__(self, path: str, busy_timeout_ms: int = 30_000) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        _to_wal(self._db, busy_timeout_ms / 1e3)
        self._db.execute("PRAGMA synchronous=NORMAL")  # durable across process crashes
        self._db.executescript(_SCHEMA)
        self._db.execute("BEGIN IMMEDIATE")  # one process at a time migrates
        try:
            have = {r[1] for r in self._db.execute("PRAGMA table_info(conversations)")}
            for name, decl in ADDED_COLUMNS:
                if name not in have:
                    self._db.execute(f"ALTER TABLE conversations ADD COLUMN {name} {decl}")
            self._db.execute(REQUEST_INDEX)
            for row in self._db.execute(unstamped("?"), ("",)).fetchall():
                self._db.execute(*stamp_statement(row, "?"))
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def close(self) -> None:
        """Merge the write-ahead log into the database file (when no other process reads
        it) and close."""
        with self._lock:
            try:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error:
                pass  # another process holds it: the last one to close merges it
            self._db.close()

    def _write(self, sql: str, params: tuple[Any, ...]) -> int:
        """Run one write; its changed row count. A failure is :class:`StoreWriteError`."""
        with self._lock:
            try:
                return int(self._db.execute(sql, params).rowcount)
            except sqlite3.Error as e:
                raise StoreWriteError(e) from e

    def probe(self) -> None:
        """A write to the store's own table (:data:`PROBE`): raises
        :class:`StoreWriteError` when the store takes no writes."""
        self._write(PROBE.format(ph="?"), (str(time.time()),))

    def ids(self) -> list[str]:
        """Every conversation's id (for the check at start)."""
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT id FROM conversations")]

    def quick_check(self) -> list[str]:
        """``PRAGMA quick_check``'s findings: empty when the file is sound."""
        with self._lock:
            found = [str(r[0]) for r in self._db.execute("PRAGMA quick_check").fetchall()]
        return [] if found == ["ok"] else found

    def get(self, conversation_id: str) -> StoredConversation | None:
        with self._lock:
            try:
                row = self._db.execute(
                    f"SELECT {SELECT_COLUMNS} FROM conversations WHERE id = ?",
                    (conversation_id,)).fetchone()
            except sqlite3.OperationalError as e:  # locked, I/O: the store, not the row
                raise StoreWriteError(e, "read") from e
            except sqlite3.DatabaseError as e:  # a damaged page
                raise CorruptConversationError(conversation_id, f"unreadable: {e}") from e
        return None if row is None else from_row(row, conversation_id)

    def find_by_messages(self, tenant: str, messages: list[dict[str, Any]]) -> str | None:
        """The tenant's conversation whose messages are exactly ``messages``, if any."""
        h = messages_hash(tenant, messages)
        with self._lock:
            row = self._db.execute(
                "SELECT id FROM conversations WHERE tenant = ? AND messages_hash = ? "
                "ORDER BY updated DESC LIMIT 1", (tenant, h)).fetchone()
        return row[0] if row else None

    def find_by_request(self, tenant: str, request_key: str) -> str | None:
        """The tenant's conversation whose last turn the request ``request_key`` wrote."""
        with self._lock:
            row = self._db.execute(
                "SELECT id FROM conversations WHERE tenant = ? AND request_key = ?",
                (tenant, request_key)).fetchone()
        return row[0] if row else None

    def save_turn(self, conv: StoredConversation) -> None:
        """Write the conversation after a completed turn (one statement; committed when it
        returns), if its row is still at ``conv.version``; else :class:`StaleTurnError`."""
        stamp(conv)
        written(conv, self._write(*write_statement(conv, "?")))

    def set_hints(self, conversation_id: str, priority: float, keep_alive_s: float) -> None:
        self._write("UPDATE conversations SET priority = ?, keep_alive_s = ? WHERE id = ?",
                    (priority, keep_alive_s, conversation_id))

    def delete(self, conversation_id: str) -> bool:
        return self._write("DELETE FROM conversations WHERE id = ?", (conversation_id,)) > 0

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM conversations").fetchone()[0])
