"""A throwaway PostgreSQL database for the tests.

When ``PENSIEVE_TEST_POSTGRES_URL`` names a server (``scripts/check.sh`` starts one for the
whole run, ``scripts/pg_ci.py``), each :func:`postgres_url` is a new database on it, dropped
afterwards. Otherwise a server of its own: ``pgserver`` (a pip-installable build) when it is
installed, else the ``initdb``/``pg_ctl`` binaries on PATH or in /usr/local/bin (as a non-root
user), started in a temporary directory, stopped and removed afterwards."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

ENV = "PENSIEVE_TEST_POSTGRES_URL"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _binary(name: str) -> str | None:
    return shutil.which(name) or (f"/usr/local/bin/{name}"
                                  if os.access(f"/usr/local/bin/{name}", os.X_OK) else None)


@contextlib.contextmanager
def fresh_database(server_url: str) -> Iterator[str]:
    """A new database on the server at ``server_url``: yield its URL, drop it."""
    import psycopg

    name = "pensieve_test_" + uuid.uuid4().hex[:12]
    with psycopg.connect(server_url, autocommit=True) as db:
        db.execute(f"CREATE DATABASE {name}")
    try:
        yield urlunsplit(urlsplit(server_url)._replace(path="/" + name))
    finally:
        with psycopg.connect(server_url, autocommit=True) as db:
            db.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@contextlib.contextmanager
def postgres_url() -> Iterator[str]:
    """Yield the URL of a database of its own: on the server ``PENSIEVE_TEST_POSTGRES_URL``
    names, else on a server started for it (and stopped afterwards)."""
    shared = os.environ.get(ENV)
    if shared:
        with fresh_database(shared) as url:
            yield url
        return
    root = tempfile.mkdtemp(prefix="pensieve-pg-")
    try:
        try:
            import pgserver
        except ImportError:
            pgserver = None
        if pgserver is not None:
            srv = pgserver.get_server(os.path.join(root, "data"), cleanup_mode="stop")
            try:
                yield srv.get_uri()
            finally:
                srv.cleanup()
            return
        initdb, pg_ctl = _binary("initdb"), _binary("pg_ctl")
        if initdb is None or pg_ctl is None or os.geteuid() == 0:
            raise RuntimeError("no PostgreSQL server: install pgserver (pip install -e "
                               "'.[replicas]') or run as a non-root user with initdb/pg_ctl")
        data, port = os.path.join(root, "data"), _free_port()
        subprocess.run([initdb, "-D", data, "-U", "postgres", "--auth=trust"], check=True,
                       capture_output=True)
        subprocess.run([pg_ctl, "-D", data, "-o", f"-p {port} -k {root} -h 127.0.0.1",
                        "-l", os.path.join(root, "log"), "-w", "start"], check=True,
                       capture_output=True)
        try:
            yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
        finally:
            subprocess.run([pg_ctl, "-D", data, "-m", "fast", "-w", "stop"],
                           capture_output=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
