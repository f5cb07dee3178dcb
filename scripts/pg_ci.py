"""Start or stop the PostgreSQL server the test run shares (``pgserver``, a pip-installable
build the ``replicas`` extra installs)::

    url=$(python scripts/pg_ci.py start DIR)   # data in DIR/data; prints the server's URL
    python scripts/pg_ci.py stop DIR           # stops it, removes DIR

``scripts/check.sh`` runs it around the tests and exports the URL as
``PENSIEVE_TEST_POSTGRES_URL``; ``tests/pg_server.py`` then gives each test that needs
PostgreSQL a new database on that server instead of starting a server of its own.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path


def start(root: Path) -> str:
    import pgserver

    # cleanup_mode=None: the server keeps running when this process exits
    return str(pgserver.get_server(root / "data", cleanup_mode=None).get_uri())


def _postmaster(data: Path) -> int | None:
    try:
        return int((data / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def stop(root: Path) -> None:
    data = root / "data"
    pid = _postmaster(data)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGINT)  # PostgreSQL's fast shutdown (pg_ctl -m fast)
        except ProcessLookupError:
            pid = None
    deadline = time.monotonic() + 60
    while pid is not None and _postmaster(data) == pid and time.monotonic() < deadline:
        time.sleep(0.1)
    shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        print(__doc__, file=sys.stderr)
        return 2
    root = Path(argv[1])
    if argv[0] == "start":
        print(start(root))
    else:
        stop(root)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
