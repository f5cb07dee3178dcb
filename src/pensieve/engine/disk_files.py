"""One file per chunk of the disk tier: its format, and checking it (no torch).

A file is ``MAGIC``, a 4-byte little-endian header length, a JSON header, then the payload:
the chunk's K and V over all layers as the CPU tier holds them (``[L, 2, C, Hkv, D]``,
contiguous). The header carries:

- ``fingerprint``: model, dtype, KV dtype, chunk size and KV layout (:func:`fingerprint`); a
  file of another one is never read;
- ``conversation_id``, ``index``, ``tokens``, ``prefix_hash``: which chunk, of which tokens
  (:mod:`pensieve.core.disk_index`: a full chunk's salted shared-prefix hash, its
  conversation empty since any conversation of that salt may read it; a partial last
  chunk's conversation and :func:`~pensieve.core.disk_index.partial_hash`);
- ``nbytes`` and ``crc32`` of the payload; ``written_at`` (seconds since the epoch).

:func:`decode` returns the payload only if every check passes; anything else (a missing,
truncated, corrupt or foreign file) is None, and the chunk is recomputed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"PNSVKV1\n"
_LEN = struct.Struct("<I")
MAX_HEADER = 1 << 16


def fingerprint(model: str, dtype: str, kv_dtype: str, chunk_size: int, num_layers: int,
                num_kv_heads: int, head_dim: int, weights: str = "") -> str:
    """What must be equal for a file's KV to be usable by this engine: ``weights`` is a
    digest of the weights and the model's config (``disk_build.model_digest``), so that new
    weights under the same path never read the old KV."""
    return (f"model={model};dtype={dtype};kv_dtype={kv_dtype};chunk={chunk_size};"
            f"layers={num_layers};kv_heads={num_kv_heads};head_dim={head_dim};layout=L2CHD;"
            f"weights={weights}")


@dataclass(frozen=True)
class Header:
    fingerprint: str
    conversation_id: str
    index: int
    tokens: int
    prefix_hash: str
    nbytes: int
    crc32: int
    written_at: float


def encode_head(header: Header) -> bytes:
    """The file's bytes before the payload (``header.nbytes`` and ``crc32`` describe it)."""
    head = json.dumps(header.__dict__, sort_keys=True).encode()
    return MAGIC + _LEN.pack(len(head)) + head


def make_header(fp: str, conversation_id: str, index: int, tokens: int, prefix_hash: str,
                payload: memoryview, written_at: float) -> Header:
    return Header(fp, conversation_id, index, tokens, prefix_hash, payload.nbytes,
                  zlib.crc32(payload), written_at)


def read_header(path: str) -> Header | None:
    """The header of the file at ``path`` (None: unreadable or malformed)."""
    try:
        with open(path, "rb") as f:
            start = f.read(len(MAGIC) + _LEN.size)
            if len(start) != len(MAGIC) + _LEN.size or not start.startswith(MAGIC):
                return None
            (n,) = _LEN.unpack(start[len(MAGIC):])
            if n > MAX_HEADER:
                return None
            return _parse(f.read(n))
    except OSError:
        return None


def _parse(raw: bytes) -> Header | None:
    try:
        d = json.loads(raw)
        return Header(str(d["fingerprint"]), str(d["conversation_id"]), int(d["index"]),
                      int(d["tokens"]), str(d["prefix_hash"]), int(d["nbytes"]),
                      int(d["crc32"]), float(d["written_at"]))
    except (ValueError, KeyError, TypeError):
        return None


def decode(data: bytearray | memoryview, fp: str, conversation_id: str, index: int,
           tokens: int, prefix_hash: str, nbytes: int) -> memoryview | None:
    """The payload of a file's bytes (a view, no copy) if it is the expected chunk, intact;
    else None."""
    view = memoryview(data)
    if len(view) < len(MAGIC) + _LEN.size or view[:len(MAGIC)] != MAGIC:
        return None
    (n,) = _LEN.unpack_from(view, len(MAGIC))
    start = len(MAGIC) + _LEN.size + n
    h = _parse(bytes(view[len(MAGIC) + _LEN.size:start])) if n <= MAX_HEADER else None
    if h is None or (h.fingerprint, h.conversation_id, h.index, h.tokens, h.prefix_hash,
                     h.nbytes) != (fp, conversation_id, index, tokens, prefix_hash, nbytes):
        return None
    payload = view[start:]
    if payload.nbytes != nbytes or zlib.crc32(payload) != h.crc32:
        return None
    return payload


READ_SLACK = 4096
"""Bytes a new read buffer has beyond its file, so files of the same payload with longer
headers (a longer conversation id) can be read into it later."""


class ReadBuffer(np.ndarray[Any, np.dtype[np.uint8]]):
    """A buffer files are read into (bytes, 1-D): an anonymous mapping, not filled, so its
    pages are first touched by the kernel inside ``readinto``, with the GIL released (a
    ``bytearray(n)`` is zero-filled with the GIL held: reader threads take turns on it). Its
    type tells a read buffer from other bytes (a queued write's) for reuse."""


def new_buffer(size: int) -> ReadBuffer:
    """An unfilled read buffer of ``size`` bytes. Not ``np.empty``: numpy advises huge pages
    for large arrays, and reads into fresh buffers so advised mostly ran at half the rate on
    the development VM (docs/performance.md)."""
    return np.frombuffer(mmap.mmap(-1, size), np.uint8).view(ReadBuffer)


def read_file(path: str, spare: ReadBuffer | None = None) -> memoryview:
    """A whole file's bytes (OSError if it cannot be read): read into ``spare`` if it is large
    enough (a buffer read into before: no fresh pages to fault in), else into a new buffer
    (:func:`new_buffer`); a view of the bytes read, whose ``obj`` is the buffer."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        buf = spare if spare is not None and len(spare) >= size else new_buffer(
            size + READ_SLACK)
        view = memoryview(buf)  # type: ignore[arg-type]
        got = f.readinto(view[:size])
    return view[:got]


def write_atomic(path: str, head: bytes, payload: memoryview,
                 tmp_suffix: str = ".tmp") -> None:
    """Write ``head`` and ``payload`` to ``path`` through a temporary file (``path +
    tmp_suffix``: a name of the writer's own where several write one directory) and a rename
    (a crash leaves the old file or none, never half of one under the name)."""
    tmp = path + tmp_suffix
    try:
        with open(tmp, "wb", buffering=0) as f:
            _write_all(f, memoryview(head))
            _write_all(f, payload)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


TMP_SUFFIX = ".tmp"
"""A file being written (:func:`write_atomic`); one left by a crash is removed at start."""


def _write_all(f: Any, data: memoryview) -> None:
    """Write every byte of ``data`` (a raw file's ``write`` may take fewer: a full disk);
    OSError when the disk takes none."""
    data = data.cast("B")
    done = 0
    while done < len(data):
        n = f.write(data[done:])
        if not n:
            raise OSError(errno.ENOSPC, f"short write: {done} of {len(data)} bytes")
        done += n


def check_writable(directory: str) -> None:
    """Raise ValueError with the reason when ``directory`` cannot hold the disk tier."""
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, ".pensieve-write-probe")
        with open(probe, "wb") as f:
            f.write(b"probe")
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"--disk-kv-path {directory!r} is not writable: {e}") from e
