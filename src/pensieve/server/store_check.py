"""The conversation store checked before the server starts, so that a store the server cannot
use stops it at once with one line (:class:`StoreOpenError`), and a damaged store that still
opens is served with its bad conversations named.

At open, in order:

1. SQLite only, before connecting: the write-ahead log (``<store>-wal``) is read frame by
   frame (:func:`wal_damage`). SQLite silently ignores every frame after the first one whose
   checksum fails, so garbage in the log would drop committed turns without a word; a log
   with frames of the current generation after a broken one refuses to open instead.
2. The connection (a file that is not a database, a directory that cannot be created or
   written: refused).
3. ``PRAGMA quick_check``: its findings logged as an error; the store still opens.
4. A write probe (:data:`~pensieve.server.store_sqlite.PROBE`): a read-only file, directory or
   mount, or a full disk, refuses to open.
5. Every row read and its checksum verified: the corrupt ones are logged by id and listed
   in :class:`StoreReport` (``/health`` counts them); each is refused when asked for.
"""

from __future__ import annotations

import logging
import sqlite3
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from pensieve.server.store_sqlite import (
    ConversationStore,
    CorruptConversationError,
    Store,
    StoreWriteError,
)

log = logging.getLogger("pensieve.server")

WAL_MAGIC = (0x377F0682, 0x377F0683)
"""The log's magic numbers: checksum words little-endian, big-endian."""
WAL_HEADER, FRAME_HEADER = 32, 24


class StoreOpenError(Exception):
    """The store named by ``--store`` cannot be used: ``pensieve serve`` exits with this
    message (status 2) before the engine starts."""


@dataclass
class StoreReport:
    """What the check at open found in a store that opened."""

    quick_check: list[str] = field(default_factory=list)
    """``PRAGMA quick_check``'s findings (empty: ok; always empty on PostgreSQL)."""
    corrupt: list[str] = field(default_factory=list)
    """Ids of the conversations that failed their checksum or could not be read."""


def _checksum(data: bytes, big: bool, s0: int, s1: int) -> tuple[int, int]:
    """SQLite's WAL checksum of ``data`` (a multiple of 8 bytes), continued from (s0, s1)."""
    words = struct.unpack(f"{'>' if big else '<'}{len(data) // 4}I", data)
    for i in range(0, len(words), 2):
        s0 = (s0 + words[i] + s1) & 0xFFFFFFFF
        s1 = (s1 + words[i + 1] + s0) & 0xFFFFFFFF
    return s0, s1


def wal_damage(db_path: str) -> str | None:
    """Why the write-ahead log of ``db_path`` would lose committed data, or None (no log, an
    empty one, or one whose frames of the current generation all verify). Frames of an
    older generation after the valid ones are normal (the log is reused from its start)."""
    path = Path(db_path + "-wal")
    data = path.read_bytes() if path.exists() else b""
    if not data:
        return None
    if len(data) < WAL_HEADER:
        return f"{path} is {len(data)} bytes, shorter than a log header"
    magic, _, page_size = struct.unpack(">III", data[:12])
    if magic not in WAL_MAGIC:
        return f"{path} has no write-ahead log header (magic {magic:#010x})"
    big = magic == WAL_MAGIC[1]
    salts = data[16:24]
    sums = _checksum(data[:24], big, 0, 0)
    if struct.unpack(">II", data[24:32]) != sums:
        return f"{path} has a corrupt header (checksum mismatch)"
    size = FRAME_HEADER + page_size
    n = (len(data) - WAL_HEADER) // size
    valid = n
    for i in range(n):
        off = WAL_HEADER + i * size
        frame = data[off:off + size]
        if frame[8:16] != salts:
            valid = i
            break
        sums = _checksum(frame[:8] + frame[FRAME_HEADER:], big, *sums)
        if struct.unpack(">II", frame[16:24]) != sums:
            valid = i
            break
    cut = [i for i in range(valid + 1, n)
           if data[WAL_HEADER + i * size + 8:WAL_HEADER + i * size + 16] == salts]
    if cut:
        return (f"{path}: frame {valid} is corrupt and {len(cut)} later frame(s) of the log "
                "would be discarded with it")
    return None


def _open_sqlite(path: str) -> ConversationStore:
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StoreOpenError(f"cannot create the store's directory: {e}") from e
    why = wal_damage(path)
    if why is not None:  # a writer on another process may have been mid-frame: look again
        time.sleep(0.2)
        why = wal_damage(path)
    if why is not None:
        raise StoreOpenError(f"the store's write-ahead log is damaged ({why}): committed "
                             "turns in it would be lost. Restore it from a backup, or move "
                             "the -wal file aside to start without them")
    return ConversationStore(path)


def open_checked(target: str) -> tuple[Store, StoreReport]:
    """The store at ``target`` (a SQLite path or a PostgreSQL URL), checked as the module
    docstring says, and what the check found; :class:`StoreOpenError` when it is unusable."""
    store: Store | None = None
    try:
        if target.startswith(("postgresql://", "postgres://")):
            from pensieve.server.store_pg import PostgresStore

            store = PostgresStore(target)
        else:
            store = _open_sqlite(target)
        report = _check(store, target)
    except StoreOpenError:
        _close(store)
        raise
    except Exception as e:  # noqa: BLE001 - sqlite3, OSError, psycopg: all mean unusable
        _close(store)
        why = e.message if isinstance(e, StoreWriteError) else f"{type(e).__name__}: {e}"
        raise StoreOpenError(f"cannot open the conversation store {target}: {why}") from e
    return store, report


def _check(store: Store, target: str) -> StoreReport:
    """Steps 3 to 5 on an open store: quick_check, the write probe, every row."""
    report = StoreReport(quick_check=store.quick_check()
                         if isinstance(store, ConversationStore) else [])
    if report.quick_check:
        log.error("store %s: PRAGMA quick_check found damage: %s", target,
                  "; ".join(report.quick_check[:5]))
    try:
        store.probe()
    except StoreWriteError as e:
        raise StoreOpenError(f"the conversation store {target} takes no writes (read-only "
                             f"file, directory or mount, or a full disk): {e.message}") from e
    ids = store.ids()
    for cid in ids:
        try:
            store.get(cid)
        except CorruptConversationError:
            report.corrupt.append(cid)
    if report.corrupt:
        log.error("store %s: %d conversation(s) are corrupt and will be refused: %s", target,
                  len(report.corrupt), ", ".join(report.corrupt[:20]))
    log.info("store %s: quick_check %s, %d conversation(s) verified", target,
             "found damage" if report.quick_check else "ok", len(ids) - len(report.corrupt))
    return report


def _close(store: Store | None) -> None:
    if store is not None:
        try:
            store.close()
        except (sqlite3.Error, OSError):
            pass
