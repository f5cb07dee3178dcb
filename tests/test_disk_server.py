"""``pensieve serve --disk-kv-gb --disk-kv-path`` across a restart: the stopped server writes
its conversations' KV to disk, the restarted one (same store, same path) continues them with
>= 90% of their context read back from disk, answering what a server without the disk tier
answers from the same store (recomputing)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from server_util import Server, run_cache

GREEDY = {"temperature": 0.0, "max_tokens": 48}


def _cache(r: object) -> dict:
    return ((getattr(r, "model_extra", None) or {}).get("pensieve") or {})["cache"]


def _continue(srv: Server, cids: list[str]) -> tuple[list[str], list[dict]]:
    client = srv.client()
    answers, caches = [], []
    for cid in cids:
        r = client.chat.completions.create(
            model="pensieve-demo", messages=[{"role": "user", "content": "And then?"}],
            extra_body={"conversation_id": cid}, **GREEDY)
        answers.append(r.choices[0].message.content)
        caches.append(_cache(r))
    return answers, caches


@pytest.mark.slow  # ~40 s: two server starts on the default model
def test_restarted_server_resumes_from_disk(tmp_path: Path) -> None:
    # chunks of 16: a turn's rendering may differ from the stored history in its last tokens
    # (the end-of-turn text), which cuts the last chunk; the rest must come from disk
    disk = ["--chunk-size", "16", "--disk-kv-gb", "0.05", "--disk-kv-path", str(tmp_path / "kv")]
    store, cache_dir = tmp_path / "conv.db", run_cache()
    srv = Server(store, cache_dir, *disk)
    try:
        client = srv.client()
        cids = []
        for i in range(3):
            r = client.chat.completions.create(
                model="pensieve-demo",
                messages=[{"role": "user", "content": f"Tell me about topic {i} at length."}],
                **GREEDY)
            cid = (r.model_extra or {})["conversation_id"]
            for more in ("Go on.", "More, please."):
                client.chat.completions.create(
                    model="pensieve-demo", messages=[{"role": "user", "content": more}],
                    extra_body={"conversation_id": cid}, **GREEDY)
            cids.append(cid)
    finally:
        srv.stop()
    assert any(p.suffix == ".kv" for p in (tmp_path / "kv").iterdir())
    shutil.copy(store, tmp_path / "cold.db")  # the same conversations, for a cold server

    srv2 = Server(store, cache_dir, *disk)
    try:
        warm, caches = _continue(srv2, cids)
    finally:
        srv2.stop()
    srv3 = Server(tmp_path / "cold.db", cache_dir, "--chunk-size", "16")
    try:
        cold, cold_caches = _continue(srv3, cids)
    finally:
        srv3.stop()
    assert warm == cold
    for c, cc in zip(caches, cold_caches):
        context = cc["recomputed_tokens"] + cc["gpu_hit_tokens"] + cc["cpu_hit_tokens"]
        assert cc["disk_hit_tokens"] == 0 and context > 0
        assert c["disk_hit_tokens"] >= 0.9 * context, (c, cc)
