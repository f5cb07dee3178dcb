"""The conversation store on PostgreSQL (through ``psycopg``), for replicas on several hosts.

Same rows and the same :class:`~pensieve.server.store_sqlite.Store` interface as the SQLite store:
one row per conversation, written in one statement when a turn completes (conditional on
the version the turn read, as there: a conversation that moved to another replica gets its
next turn written there, a stale turn is refused). One connection per process in autocommit
mode, behind a lock; a connection the server dropped is reopened once per call. Rows carry
the same checksum, verified on every read (:func:`~pensieve.server.store_sqlite.from_row`); a write
that fails raises :class:`~pensieve.server.store_sqlite.StoreWriteError`.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg

from pensieve.server.store_sqlite import (
    ADDED_COLUMNS,
    PROBE,
    REQUEST_INDEX,
    SELECT_COLUMNS,
    StoredConversation,
    StoreWriteError,
    from_row,
    messages_hash,
    schema,
    stamp,
    stamp_statement,
    unstamped,
    write_statement,
    written,
)

_SCHEMA = schema("DOUBLE PRECISION")


class PostgresStore:
    """The PostgreSQL store at ``url`` (``postgresql://user:pw@host:port/db``)."""

    def __init__(self, url: str) -> None:
        self.path = url
        self._lock = threading.Lock()
        self._db = psycopg.connect(url, autocommit=True)
        with self._lock:
            # Several replicas may start at once: serialize the schema creation.
            self._db.execute("SELECT pg_advisory_lock(4242)")
            try:
                self._db.execute(_SCHEMA)
                for name, decl in ADDED_COLUMNS:  # a table made by an older version
                    self._db.execute(
                        f"ALTER TABLE conversations ADD COLUMN IF NOT EXISTS {name} {decl}")
                self._db.execute(REQUEST_INDEX)
                for row in self._db.execute(unstamped("%s"), ("",)).fetchall():
                    self._db.execute(*stamp_statement(row, "%s"))
            finally:
                self._db.execute("SELECT pg_advisory_unlock(4242)")

    def _run(self, sql: str, params: tuple[Any, ...] = ()) -> psycopg.Cursor[Any]:
        with self._lock:
            if self._db.closed:
                self._db = psycopg.connect(self.path, autocommit=True)
            return self._db.execute(sql, params)

    def _write(self, sql: str, params: tuple[Any, ...]) -> int:
        """Run one write; its changed row count. A failure is :class:`StoreWriteError`."""
        try:
            return int(self._run(sql, params).rowcount)
        except psycopg.Error as e:
            raise StoreWriteError(e) from e

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def probe(self) -> None:
        """A write to the store's own table: :class:`StoreWriteError` when it takes none."""
        self._write(PROBE.format(ph="%s"), (str(time.time()),))

    def ids(self) -> list[str]:
        """Every conversation's id (for the check at start)."""
        return [r[0] for r in self._run("SELECT id FROM conversations").fetchall()]

    def get(self, conversation_id: str) -> StoredConversation | None:
        row = self._run(f"SELECT {SELECT_COLUMNS} FROM conversations WHERE id = %s",
                        (conversation_id,)).fetchone()
        return None if row is None else from_row(row, conversation_id)

    def find_by_messages(self, tenant: str, messages: list[dict[str, Any]]) -> str | None:
        """The tenant's conversation whose messages are exactly ``messages``, if any."""
        row = self._run("SELECT id FROM conversations WHERE tenant = %s AND messages_hash = %s "
                        "ORDER BY updated DESC LIMIT 1",
                        (tenant, messages_hash(tenant, messages))).fetchone()
        return row[0] if row else None

    def find_by_request(self, tenant: str, request_key: str) -> str | None:
        """The tenant's conversation whose last turn the request ``request_key`` wrote."""
        row = self._run("SELECT id FROM conversations WHERE tenant = %s AND request_key = %s",
                        (tenant, request_key)).fetchone()
        return row[0] if row else None

    def save_turn(self, conv: StoredConversation) -> None:
        """Write the conversation after a completed turn (one statement), if its row is still
        at ``conv.version``; else :class:`~pensieve.server.store_sqlite.StaleTurnError`."""
        stamp(conv)
        written(conv, self._write(*write_statement(conv, "%s")))

    def set_hints(self, conversation_id: str, priority: float, keep_alive_s: float) -> None:
        self._write("UPDATE conversations SET priority = %s, keep_alive_s = %s WHERE id = %s",
                    (priority, keep_alive_s, conversation_id))

    def delete(self, conversation_id: str) -> bool:
        return self._write("DELETE FROM conversations WHERE id = %s", (conversation_id,)) > 0

    def count(self) -> int:
        row = self._run("SELECT COUNT(*) FROM conversations").fetchone()
        return int(row[0]) if row else 0
