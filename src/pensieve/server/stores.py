"""Open the conversation store a ``--store`` value names: SQLite (:mod:`.store`) for a path,
PostgreSQL (:mod:`.store_pg`) for a URL. Apart from both so that neither imports the other's
backend (``store_pg`` builds on ``store``'s rows)."""

from __future__ import annotations

from pathlib import Path

from pensieve.server.store import ConversationStore, Store


def open_store(target: str) -> Store:
    """The store at ``target``: a ``postgresql://`` (or ``postgres://``) URL, else the path of
    a SQLite file (its directory is created)."""
    if target.startswith(("postgresql://", "postgres://")):
        from pensieve.server.store_pg import PostgresStore

        return PostgresStore(target)
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    return ConversationStore(target)
