"""``pensieve serve`` as a process under faults: a store it cannot use stops it at once
(status 2, one line, no engine started); SIGTERM and SIGINT shut it down the same way
(drain, store closed with its log merged, status 0); an engine process killed under load
stops the server with status 1, and the restarted server has every completed turn."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from server_util import Server, run_cache

from pensieve.server.store_sqlite import ConversationStore

CHAT = "/v1/chat/completions"
TINY = ["serve", "llama-tiny", "--load-format", "dummy", "--device", "cpu",
        "--num-gpu-blocks", "8", "--port", "0"]


def test_a_store_that_cannot_be_opened_stops_serve_before_the_engine(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Garbage for a store: status 2, the store named on one line, and no engine process
    was ever started (it used to start first, then hold the server up)."""
    from pensieve.cli import main

    bad = tmp_path / "conv.db"
    bad.write_bytes(b"not a database at all " * 400)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    assert main([*TINY, "--store", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"cannot open the conversation store {bad}" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_serve_with_a_broken_store_exits_at_once(tmp_path: Path) -> None:
    """The process itself, as a user starts it: it exits 2 with the message (it used to
    print a traceback and stay alive for minutes with its engine process)."""
    bad = tmp_path / "conv.db"
    bad.write_bytes(b"\x00garbage" * 1000)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pensieve.cli", *TINY, "--store", str(bad)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "pensieve: error: cannot open the conversation store" in r.stderr, r.stderr[-2000:]
    print(f"\nserve with a broken store exited in {time.monotonic() - t0:.1f} s")


@pytest.mark.slow  # ~12 s each: a server started and stopped under load
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_and_sigint_shut_down_the_same_way(sig: int, tmp_path: Path) -> None:
    """Either signal: the turn in flight finishes, the store is closed with its write-ahead
    log merged into the file, status 0."""
    store = tmp_path / "conv.db"
    srv = Server(store, run_cache())
    r = httpx.post(srv.url + CHAT, timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    cid = r.json()["conversation_id"]
    events = []
    with httpx.stream("POST", srv.url + CHAT, timeout=120, json={
            "messages": [{"role": "user", "content": "long"}], "max_tokens": 32,
            "ignore_eos": True, "stream": True}) as s:
        lines = s.iter_lines()
        events.append(next(lines))
        srv.proc.send_signal(sig)
        events += list(lines)
    assert srv.proc.wait(timeout=60) == 0
    srv.log.close()
    log = Path(srv.log.name).read_text()
    assert "Traceback" not in log, log[-3000:]
    data = [e for e in events if e]
    assert data[-1] == "data: [DONE]" and '"finish_reason":"length"' in data[-2].replace(
        " ", ""), data[-3:]
    wal = Path(str(store) + "-wal")
    assert not wal.exists() or wal.stat().st_size == 0, wal.stat().st_size
    again = ConversationStore(str(store))
    try:
        assert again.count() == 2 and again.get(cid) is not None
    finally:
        again.close()


def _engine_child(server_pid: int) -> psutil.Process:
    """The server's engine process (spawned, or forked for a CPU engine: then its command
    line is the server's)."""
    kids = [p for p in psutil.Process(server_pid).children()
            if "resource_tracker" not in " ".join(p.cmdline())]
    assert len(kids) == 1, [p.cmdline() for p in kids]
    return kids[0]


def _stream(url: str, body: dict[str, Any], out: list[list[str]]) -> None:
    try:
        with httpx.stream("POST", url + CHAT, timeout=120, json={**body, "stream": True}) as s:
            out.append([line for line in s.iter_lines() if line])
    except httpx.HTTPError as e:
        out.append([f"closed: {e}"])


@pytest.mark.slow  # ~20 s: two servers
def test_a_killed_engine_stops_the_server_and_no_completed_turn_is_lost(
        tmp_path: Path) -> None:
    """kill -9 of the engine process with streams in flight: the server exits 1 (for its
    supervisor to restart it) instead of answering 500 forever; every turn completed before
    is in the store, and the restarted server continues the conversations."""
    store, cache = tmp_path / "conv.db", run_cache()
    srv = Server(store, cache)
    done: dict[str, int] = {}
    for i in range(4):
        r = httpx.post(srv.url + CHAT, timeout=60, json={
            "messages": [{"role": "user", "content": f"turn {i}"}], "max_tokens": 4})
        cid = r.json()["conversation_id"]
        r = httpx.post(srv.url + CHAT, timeout=60, json={
            "messages": [{"role": "user", "content": "again"}], "conversation_id": cid,
            "max_tokens": 4})
        assert r.status_code == 200
        done[cid] = 2
    out: list[list[str]] = []
    streams = [threading.Thread(target=_stream, args=(srv.url, {
        "messages": [{"role": "user", "content": f"load {i}"}], "max_tokens": 300,
        "ignore_eos": True}, out)) for i in range(3)]
    for t in streams:
        t.start()
    time.sleep(1.0)
    _engine_child(srv.proc.pid).kill()
    t0 = time.monotonic()
    assert srv.proc.wait(timeout=60) == 1
    took = time.monotonic() - t0
    for t in streams:
        t.join(timeout=60)
    srv.log.close()
    log = Path(srv.log.name).read_text()
    assert "the engine stopped: the server shuts down and exits with status 1" in log, log[-3000:]
    for lines in out:  # each stream ended with an error event and [DONE], or was cut
        if lines and lines[-1] == "data: [DONE]":
            data = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
            assert "error" in data[-1], data[-1]
    print(f"\nengine killed: the server exited 1 in {took:.1f} s")
    # one conversation edited in the store meanwhile: the restarted server names it
    cid, edited = list(done)[:2]
    raw = sqlite3.connect(store)
    raw.execute("UPDATE conversations SET token_ids = '[1, 2, 3]' WHERE id = ?", (edited,))
    raw.commit()
    raw.close()
    srv2 = Server(store, cache)
    try:
        health = httpx.get(srv2.url + "/health").json()
        assert health["status"] == "ok" and health["store"]["corrupt_conversations"] == 1
        for c, turns in done.items():
            r = httpx.get(f"{srv2.url}/v1/conversations/{c}")
            if c == edited:
                assert r.json()["error"]["code"] == "conversation_corrupt"
                continue
            assert len(r.json()["turns"]) == turns, r.json()
        r = httpx.post(srv2.url + CHAT, timeout=60, json={
            "messages": [{"role": "user", "content": "after"}], "conversation_id": cid,
            "max_tokens": 4})
        assert r.status_code == 200 and r.json()["pensieve"]["stored"] is True
        assert r.json()["pensieve"]["cache"]["recomputed_tokens"] > 0
    finally:
        srv2.stop()
    log = Path(srv2.log.name).read_text()
    assert f"1 conversation(s) are corrupt and will be refused: {edited}" in log, log[-3000:]
