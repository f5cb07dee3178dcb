"""Persistent conversation store: one interface (:class:`Store`), SQLite in WAL mode here,
PostgreSQL in :mod:`.store_pg`; :func:`pensieve.server.stores.open_store` picks one from a
path or a URL.

Replicas on one host share one SQLite file (WAL lets readers run beside the one writer; a
writer waits up to ``busy_timeout`` for another); replicas on several hosts share a
PostgreSQL database. Either way any replica can continue any conversation from the store.

One row per conversation: owner (tenant), messages (JSON), the raw token history (every input
and output token, the engine's ``Conversation.token_ids``), per-turn boundaries, retention
hints, and a hash of the message list for recognising a client that re-sends the whole history.
A row is written when a turn completes, before the client sees the end of the answer, so a
completed turn survives a crash of the server. Dropped KV is recomputed from ``token_ids``.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol


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
    updated {real} NOT NULL
);
CREATE INDEX IF NOT EXISTS by_hash ON conversations (tenant, messages_hash);
"""


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


COLUMNS = ("id", "tenant", "messages", "token_ids", "turns", "messages_hash", "priority",
           "keep_alive_s", "created", "updated")
"""A row's columns, in the order of :func:`row_values` (shared by both stores)."""


def row_values(conv: StoredConversation) -> tuple[Any, ...]:
    """The row of ``conv`` in :data:`COLUMNS` order (JSON text for the lists)."""
    return (conv.id, conv.tenant, json.dumps(conv.messages, ensure_ascii=False),
            json.dumps(conv.token_ids), json.dumps(conv.turns),
            messages_hash(conv.tenant, conv.messages), conv.priority, conv.keep_alive_s,
            conv.created, conv.updated)


def from_row(row: tuple[Any, ...]) -> StoredConversation:
    """A conversation from a row of :data:`COLUMNS` without ``messages_hash``."""
    return StoredConversation(row[0], row[1], json.loads(row[2]), json.loads(row[3]),
                              json.loads(row[4]), float(row[5]), float(row[6]),
                              float(row[7]), float(row[8]))


SELECT_COLUMNS = ", ".join(c for c in COLUMNS if c != "messages_hash")


class Store(Protocol):
    """What the server needs of a conversation store (every method thread-safe)."""

    def get(self, conversation_id: str) -> StoredConversation | None: ...

    def find_by_messages(self, tenant: str, messages: list[dict[str, Any]]) -> str | None: ...

    def save_turn(self, conv: StoredConversation) -> None: ...

    def set_hints(self, conversation_id: str, priority: float, keep_alive_s: float) -> None: ...

    def delete(self, conversation_id: str) -> bool: ...

    def count(self) -> int: ...

    def close(self) -> None: ...


class ConversationStore:
    """The SQLite store: thread-safe access to one file (one connection, one lock per
    process; several processes may share the file)."""

    def __init__(self, path: str, busy_timeout_ms: int = 30_000) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # durable across process crashes
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def get(self, conversation_id: str) -> StoredConversation | None:
        with self._lock:
            row = self._db.execute(f"SELECT {SELECT_COLUMNS} FROM conversations WHERE id = ?",
                                   (conversation_id,)).fetchone()
        return None if row is None else from_row(row)

    def find_by_messages(self, tenant: str, messages: list[dict[str, Any]]) -> str | None:
        """The tenant's conversation whose messages are exactly ``messages``, if any."""
        h = messages_hash(tenant, messages)
        with self._lock:
            row = self._db.execute(
                "SELECT id FROM conversations WHERE tenant = ? AND messages_hash = ? "
                "ORDER BY updated DESC LIMIT 1", (tenant, h)).fetchone()
        return row[0] if row else None

    def save_turn(self, conv: StoredConversation) -> None:
        """Insert or replace the conversation after a completed turn (one transaction)."""
        now = time.time()
        conv.updated = now
        if not conv.created:
            conv.created = now
        with self._lock:
            self._db.execute(
                f"INSERT OR REPLACE INTO conversations ({', '.join(COLUMNS)})"
                f" VALUES ({', '.join('?' * len(COLUMNS))})", row_values(conv))

    def set_hints(self, conversation_id: str, priority: float, keep_alive_s: float) -> None:
        with self._lock:
            self._db.execute("UPDATE conversations SET priority = ?, keep_alive_s = ? WHERE id = ?",
                             (priority, keep_alive_s, conversation_id))

    def delete(self, conversation_id: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))
        return cur.rowcount > 0

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM conversations").fetchone()[0])
