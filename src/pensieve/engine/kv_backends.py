"""Where the chunk files of the tiers below the CPU tier live: one class per backend.

A backend stores *values* under names: a value is exactly a disk-tier chunk file's bytes
(:mod:`pensieve.engine.disk_files`: magic, header with the fingerprint, payload, crc32), a
name its file name (:func:`pensieve.core.disk_index.shared_name` for a full chunk, by its
salted chained hash; :func:`~pensieve.core.disk_index.file_name` for a partial one). A
backend only moves bytes: whoever reads checks them (:func:`disk_files.decode`) before use,
so a missing, truncated, corrupt or foreign value is a miss, never wrong KV.

- :class:`LocalDirBackend`: the local disk tier's directory (``--disk-kv-path``), this
  server's alone: a temporary file left by a crash is removed at start.
- :class:`SharedDirBackend`: ``--kv-remote file:///path``, a directory several servers read
  and write at once. Values of one fingerprint lie in a subdirectory named by its digest, so
  servers of different models, dtypes or layouts never meet. A write goes to a name of its
  own (the writer's pid and thread) and is renamed over the value's name: two servers writing
  one chunk at once each rename a whole file, and a reader sees one of them whole.
- :class:`~pensieve.engine.kv_redis.RedisBackend`: ``--kv-remote redis://host:port/db``.

Every call is batched (lists of names) and blocking; the tiers call them from their own
threads, never from a step. Failures: ``get`` gives None for what it cannot read, ``put``
an exception (or None) per value, ``contains`` and ``delete`` raise ``OSError`` when the
store cannot be reached at all.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from typing import Protocol

from pensieve.engine import disk_files

Value = tuple[str, bytes, memoryview]
"""A value to put: (name, the file's head, its payload)."""


class KVBackend(Protocol):
    """A store of chunk files by name (module docstring)."""

    url: str
    """Where it is, for logs and ``/metrics``."""

    def get(self, names: list[str],
            spares: list[disk_files.ReadBuffer | None] | None = None
            ) -> list[memoryview | None]:
        """Each name's whole value (None: missing or unreadable); ``spares``: buffers a file
        backend may read into (:func:`disk_files.read_file`)."""
        ...

    def put(self, values: list[Value]) -> list[OSError | None]:
        """Store each value whole under its name (atomically: a reader sees the old value,
        the new one, or none); per value its error, None when stored."""
        ...

    def contains(self, names: list[str]) -> list[bool]:
        """Whether each name has a value (OSError: the store cannot be reached)."""
        ...

    def delete(self, names: list[str]) -> None:
        """Remove the names' values (missing ones are no error)."""
        ...

    def close(self) -> None: ...


class LocalDirBackend:
    """The local disk tier's directory (module docstring)."""

    shared = False

    def __init__(self, path: str) -> None:
        """Raises ValueError when ``path`` cannot be written."""
        disk_files.check_writable(path)
        self.path = path
        self.url = path

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def get(self, names: list[str],
            spares: list[disk_files.ReadBuffer | None] | None = None
            ) -> list[memoryview | None]:
        out: list[memoryview | None] = []
        for i, name in enumerate(names):
            try:
                out.append(disk_files.read_file(self.file(name),
                                                spares[i] if spares is not None else None))
            except OSError:
                out.append(None)
        return out

    def put(self, values: list[Value]) -> list[OSError | None]:
        out: list[OSError | None] = []
        for name, head, payload in values:
            try:
                self._write(self.file(name), head, payload)
                out.append(None)
            except OSError as e:
                out.append(e)
        return out

    def _write(self, path: str, head: bytes, payload: memoryview) -> None:
        disk_files.write_atomic(path, head, payload)

    def contains(self, names: list[str]) -> list[bool]:
        return [os.path.exists(self.file(n)) for n in names]

    def delete(self, names: list[str]) -> None:
        for name in names:
            with contextlib.suppress(OSError):
                os.remove(self.file(name))

    def clean_temporaries(self) -> None:
        """Remove the temporary files of writes cut off by a crash or a stop (this server's
        directory: nobody else writes there)."""
        for name in os.listdir(self.path):
            if name.endswith(disk_files.TMP_SUFFIX):
                with contextlib.suppress(OSError):
                    os.remove(self.file(name))

    def close(self) -> None:
        pass


def fingerprint_digest(fingerprint: str) -> str:
    """A short name for a fingerprint (a shared store's namespace)."""
    return hashlib.blake2b(fingerprint.encode(), digest_size=8).hexdigest()


class SharedDirBackend(LocalDirBackend):
    """A directory shared by several servers (module docstring): values of this fingerprint
    in ``<root>/<digest>/``; temporary names of their own per writer; nothing removed at
    start. A directory that cannot be written at start is still read (a read-only mount
    another host fills): its writes fail and are counted."""

    shared = True

    def __init__(self, root: str, fingerprint: str) -> None:
        """Raises ValueError when ``root`` is no directory that can be read."""
        self.root = root
        self.path = os.path.join(root, fingerprint_digest(fingerprint))
        self.url = "file://" + root
        with contextlib.suppress(OSError):
            os.makedirs(self.path, exist_ok=True)
        if not os.path.isdir(self.path) or not os.access(self.path, os.R_OK | os.X_OK):
            raise ValueError(f"--kv-remote {self.url}: {self.path} is not a readable "
                             "directory")
        self.writable = True
        probe = os.path.join(self.path, f".probe.{os.getpid()}{disk_files.TMP_SUFFIX}")
        try:  # a name of this process's own: servers starting at once probe side by side
            with open(probe, "wb") as f:
                f.write(b"probe")
            os.remove(probe)
        except OSError:
            self.writable = False

    def _write(self, path: str, head: bytes, payload: memoryview) -> None:
        """Through a temporary name of this writer's own (pid and thread)."""
        disk_files.write_atomic(path, head, payload,
                                f".{os.getpid()}.{threading.get_ident()}{disk_files.TMP_SUFFIX}")
