"""Regression: a turn whose history comes back from the disk tier after a restart.

Before the fix, a restored history longer than the step's token budget made the scheduler
schedule the turn with nothing to compute (``n += num_pending - total`` went to zero or
below); the step failed (a 500), and the aborted turn left its conversation's chunks marked
on the GPU although the copies that were to fill them never ran. The retry then computed
against whatever those GPU blocks held: another tenant's deleted conversation, in the audit's
repro. Here, over HTTP with two API keys:

1. tenant A chats (three turns, history re-sent, ~340 tokens); the server stops (its KV
   written to disk);
2. the same command again; tenant B sends a private note, then deletes that conversation;
3. A continues by id: 200, and its answer equals a fresh server's (no disk tier) from the
   same store; B's note is in neither A's answer nor A's stored history.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from server_util import Server, run_cache

GREEDY = {"temperature": 0.0, "max_tokens": 40}
NOTE = "PRIVATE-NOTE: the vault code is 7319 and the password is swordfish-tango"
BUDGET = 32  # tokens a step: the restored history is 4x that and more
KEYS = ("--api-key", "key-a", "--api-key", "key-b")


def _chat(srv: Server, key: str, messages: list[dict], **extra: object) -> tuple[str, dict]:
    r = httpx.post(srv.url + "/v1/chat/completions",
                   headers={"Authorization": f"Bearer {key}"},
                   json={"model": "pensieve-demo", "messages": messages, **GREEDY, **extra},
                   timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body


@pytest.mark.slow  # three server starts on the demo model
def test_restored_history_longer_than_budget_serves_own_tokens(tmp_path: Path) -> None:
    disk = ["--disk-kv-gb", "0.05", "--disk-kv-path", str(tmp_path / "kv")]
    store, cache = tmp_path / "conv.db", run_cache()
    srv = Server(store, cache, *KEYS, *disk, budget=BUDGET)  # a budget far under the history
    try:
        msgs: list[dict] = []
        for q in ("Tell me a long story about a lighthouse keeper who lived alone on a "
                  "rocky island far out at sea, with a cat, a radio and a stack of old books.",
                  "Go on, describe the storm that came that winter in detail: the waves, the "
                  "wind, the light going dark, and the ship that was lost out there.",
                  "And what happened next, when the morning came and the sea was calm?"):
            msgs.append({"role": "user", "content": q})
            text, body = _chat(srv, "key-a", msgs)
            msgs.append({"role": "assistant", "content": text})
        cid = body["conversation_id"]
        assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] > 4 * BUDGET
    finally:
        srv.stop()
    assert any(p.suffix == ".kv" for p in (tmp_path / "kv").iterdir())
    shutil.copy(store, tmp_path / "cold.db")

    srv2 = Server(store, cache, *KEYS, *disk, budget=BUDGET)
    try:
        # tenant B writes a private note (its KV fills GPU blocks), then deletes it
        _, b = _chat(srv2, "key-b", [{"role": "user", "content": NOTE}])
        r = httpx.delete(srv2.url + f"/v1/conversations/{b['conversation_id']}",
                         headers={"Authorization": "Bearer key-b"}, timeout=30)
        assert r.status_code == 200, r.text
        warm, wbody = _chat(srv2, "key-a", [{"role": "user", "content": "Who was the hero?"}],
                            conversation_id=cid)
        hist = httpx.get(srv2.url + f"/v1/conversations/{cid}",
                         headers={"Authorization": "Bearer key-a"}, timeout=30)
        assert hist.status_code == 200
    finally:
        srv2.stop()
    srv3 = Server(tmp_path / "cold.db", cache, *KEYS, budget=BUDGET)
    try:
        cold, _ = _chat(srv3, "key-a", [{"role": "user", "content": "Who was the hero?"}],
                        conversation_id=cid)
    finally:
        srv3.stop()
    assert warm == cold
    for secret in ("7319", "swordfish", "vault", "PRIVATE"):
        assert secret not in warm and secret not in hist.text
    assert wbody["pensieve"]["cache"]["disk_hit_tokens"] > 0  # the history came from disk


def _resend(srv: Server, histories: list[list[dict]],
            question: str) -> tuple[list[str], list[dict]]:
    """Each conversation's next turn, no id, the whole history re-sent (the openai client)."""
    client = srv.client("key-a")
    answers, caches = [], []
    for msgs in histories:
        r = client.chat.completions.create(
            model="pensieve-demo", messages=[*msgs, {"role": "user", "content": question}],
            **GREEDY)
        answers.append(r.choices[0].message.content)
        cache = dict(((r.model_extra or {}).get("pensieve") or {})["cache"])
        cache["openai_cached_tokens"] = r.usage.prompt_tokens_details.cached_tokens
        caches.append(cache)
    return answers, caches


@pytest.mark.slow  # three server starts on the demo model
def test_restart_without_ids_history_resent_reads_back_from_disk(tmp_path: Path) -> None:
    """The openai client, conversations without ids, the history re-sent each turn, a disk
    tier: after a restart >= 90% of each continued turn's context is cached (read back from
    disk) and the answers equal a fresh server's without a disk tier."""
    # chunks of 16: an answer cut by max_tokens is re-rendered with its end-of-turn text, so
    # the history's last chunk differs from the re-sent one (at most one chunk recomputed)
    disk = ["--chunk-size", "16", "--disk-kv-gb", "0.05", "--disk-kv-path", str(tmp_path / "kv")]
    store, cache = tmp_path / "conv.db", run_cache()
    srv = Server(store, cache, *KEYS, *disk)
    histories: list[list[dict]] = []
    try:
        client = srv.client("key-a")
        for i in range(3):
            msgs: list[dict] = []
            for q in (f"Tell me about the island number {i} and its lighthouse.",
                      "Go on.", "What happened in the storm?"):
                msgs.append({"role": "user", "content": q})
                r = client.chat.completions.create(model="pensieve-demo", messages=msgs,
                                                   **GREEDY)
                msgs.append({"role": "assistant", "content": r.choices[0].message.content})
            histories.append(msgs)
    finally:
        srv.stop()
    shutil.copy(store, tmp_path / "cold.db")
    srv2 = Server(store, cache, *KEYS, *disk)
    try:
        warm, caches = _resend(srv2, histories, "And in the end?")
    finally:
        srv2.stop()
    srv3 = Server(tmp_path / "cold.db", cache, *KEYS, "--chunk-size", "16")
    try:
        cold, cold_caches = _resend(srv3, histories, "And in the end?")
    finally:
        srv3.stop()
    assert warm == cold
    for c, cc in zip(caches, cold_caches):
        context = cc["recomputed_tokens"] + cc["gpu_hit_tokens"] + cc["cpu_hit_tokens"]
        assert cc["disk_hit_tokens"] == 0 and context > 0
        cached = c["disk_hit_tokens"] + c["gpu_hit_tokens"] + c["cpu_hit_tokens"]
        assert cached >= 0.9 * context, (c, cc)
        # OpenAI's cached_tokens counts the KV read back from disk too (nothing computed)
        assert c["openai_cached_tokens"] == cached + c.get("shared_hit_tokens", 0), c
