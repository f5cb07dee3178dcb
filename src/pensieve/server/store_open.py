"""Open the conversation store a ``--store`` value names: SQLite (:mod:`.store_sqlite`) for a path,
PostgreSQL (:mod:`.store_pg`) for a URL, checked first (:mod:`.store_check`). Apart from both
so that neither imports the other's backend (``store_pg`` builds on ``store_sqlite``'s rows)."""

from __future__ import annotations

from pensieve.server.store_check import open_checked
from pensieve.server.store_sqlite import Store


def open_store(target: str) -> Store:
    """The store at ``target``: a ``postgresql://`` (or ``postgres://``) URL, else the path of
    a SQLite file (its directory is created). Raises
    :class:`~pensieve.server.store_check.StoreOpenError` when it cannot be used."""
    return open_checked(target)[0]
