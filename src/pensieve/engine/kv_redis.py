"""The Redis / Valkey backend of the shared KV tier (``--kv-remote redis://host:port/db``).

A value is a chunk file's bytes (:mod:`pensieve.engine.kv_backends`) under the key
``pensieve:kv:<fingerprint digest>:<name>``: servers of different models, dtypes or layouts
use different keys. Writes are ``SET`` (atomic: a reader gets the old value, the new one or
none; two servers writing one chunk at once write equal bytes); batches go in one pipeline.
The store's own memory policy bounds it (``maxmemory`` with ``allkeys-lru`` is the recipe in
docs/remote_tier.md); values carry no expiry.

Every call has a timeout (:data:`TIMEOUT_S`) and no retry: a dead or hung server costs one
timeout, after which the tier leaves it alone for a while
(:class:`~pensieve.engine.remote_tier.RemoteTier`).
"""

from __future__ import annotations

from typing import Any

from pensieve.engine import disk_files
from pensieve.engine.kv_backends import Value, fingerprint_digest

TIMEOUT_S = 2.0
"""Seconds a connect or a command may take before it counts as a failure."""


class RedisBackend:
    """A Redis or Valkey server reached with the ``redis`` client."""

    shared = True
    writable = True

    def __init__(self, url: str, fingerprint: str, timeout_s: float = TIMEOUT_S) -> None:
        """Raises OSError when the server does not answer a PING, ImportError without the
        ``redis`` package."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url = url
        self.prefix = f"pensieve:kv:{fingerprint_digest(fingerprint)}:"
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self.client: Any = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), retry_on_timeout=False, health_check_interval=0)
        try:
            self.client.ping()
        except self._errors as e:
            raise OSError(f"{url}: {e}") from e

    def _key(self, name: str) -> str:
        return self.prefix + name

    def get(self, names: list[str],
            spares: list[disk_files.ReadBuffer | None] | None = None
            ) -> list[memoryview | None]:
        if not names:
            return []
        try:
            raw = self.client.mget([self._key(n) for n in names])
        except self._errors:
            return [None] * len(names)
        # a copy the tier's restore can view as a writable tensor
        return [None if v is None else memoryview(bytearray(v)) for v in raw]

    def put(self, values: list[Value]) -> list[OSError | None]:
        if not values:
            return []
        try:
            pipe = self.client.pipeline(transaction=False)
            for name, head, payload in values:
                pipe.set(self._key(name), b"".join((head, payload)))
            pipe.execute()
        except self._errors as e:
            err = OSError(f"{self.url}: {e}")
            return [err] * len(values)
        return [None] * len(values)

    def contains(self, names: list[str]) -> list[bool]:
        if not names:
            return []
        try:
            pipe = self.client.pipeline(transaction=False)
            for n in names:
                pipe.exists(self._key(n))
            return [bool(x) for x in pipe.execute()]
        except self._errors as e:
            raise OSError(f"{self.url}: {e}") from e

    def delete(self, names: list[str]) -> None:
        if not names:
            return
        try:
            self.client.delete(*[self._key(n) for n in names])
        except self._errors as e:
            raise OSError(f"{self.url}: {e}") from e

    def close(self) -> None:
        try:
            self.client.close()
        except self._errors:
            pass
