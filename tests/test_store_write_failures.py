"""The store failing under a running server: a write that fails (a full disk, injected as
SQLite's ``OperationalError``) still answers the turn but says it is not stored (the body's
``pensieve.stored``, the ``x-pensieve-stored`` header, a stream's error event before
``[DONE]``), ``/health`` is ``degraded`` until the store writes again, and a conversation
edited in the store is refused by name, never fed to the model."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from server_scripted import build_tokenizer, scripted_app
from test_store_faults import FullDisk

CHAT = "/v1/chat/completions"


def _events(text: str) -> list[Any]:
    data = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def _app(tmp_path: Path, **kw: Any) -> tuple[Any, Any, Any]:
    tok = build_tokenizer("chatml")
    app, ex = scripted_app(tok, tmp_path / "conv.db", **kw)
    ex.script, ex.filler = [], tok.encode(" Okay.", add_special_tokens=False)[0]
    return app, ex, app.state.pensieve


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_turn_the_store_cannot_write_is_answered_as_not_stored(stream: bool,
                                                                  tmp_path: Path) -> None:
    app, _, state = _app(tmp_path)
    with TestClient(app) as http:
        r = http.post(CHAT, json={"messages": [{"role": "user", "content": "Hi"}],
                                  "max_tokens": 3})
        assert r.json()["pensieve"]["stored"] is True and r.headers["x-pensieve-stored"] == "true"
        cid = r.json()["conversation_id"]
        assert http.get("/health").json()["status"] == "ok"
        disk = FullDisk(state.store._db)
        state.store._db = disk
        turn = {"messages": [{"role": "user", "content": "More?"}], "conversation_id": cid,
                "max_tokens": 3, "stream": stream}
        r = http.post(CHAT, json=turn)
        assert r.status_code == 200, r.text
        if stream:
            events = _events(r.text)
            assert events[-1] == "[DONE]"
            err = events[-2]["error"]
            assert err["code"] == "store_unavailable" and "disk is full" in err["message"]
            last = events[-3]
            assert last["choices"][0]["finish_reason"] == "length"
            assert last["pensieve"]["stored"] is False
            assert "".join(e["choices"][0]["delta"].get("content") or ""
                           for e in events[:-2]) == " Okay" * 3
        else:
            body = r.json()
            assert body["choices"][0]["message"]["content"] == " Okay" * 3
            assert body["pensieve"]["stored"] is False
            assert r.headers["x-pensieve-stored"] == "false"
        health = http.get("/health")
        assert health.status_code == 200
        h = health.json()
        assert h["status"] == "degraded" and h["store"]["writable"] is False
        assert "disk is full" in h["store"]["error"]
        assert len(http.get(f"/v1/conversations/{cid}").json()["turns"]) == 1
        # a new conversation that cannot be stored leaves nothing behind in the engine
        r = http.post(CHAT, json={"messages": [{"role": "user", "content": "New"}],
                                  "max_tokens": 2})
        new = r.json()["conversation_id"]
        assert r.json()["pensieve"]["stored"] is False
        assert new not in state.engine.engine.cache.conversations
        assert http.get(f"/v1/conversations/{new}").status_code == 404
        # space comes back: /health's probe sees it, and the next turn is stored
        disk.full = False
        assert http.get("/health").json()["status"] == "ok"
        turn["stream"] = False
        r = http.post(CHAT, json=turn)
        assert r.json()["pensieve"]["stored"] is True
        conv = http.get(f"/v1/conversations/{cid}").json()
        assert len(conv["turns"]) == 2
        assert [m["content"] for m in conv["messages"]] == ["Hi", " Okay" * 3, "More?",
                                                            " Okay" * 3]


def _edit_row(db: Path, cid: str, old: str, new: str) -> None:
    raw = sqlite3.connect(db)
    (messages,) = raw.execute("SELECT messages FROM conversations WHERE id = ?",
                              (cid,)).fetchone()
    assert old in messages
    raw.execute("UPDATE conversations SET messages = ? WHERE id = ?",
                (messages.replace(old, new, 1), cid))
    raw.commit()
    raw.close()


@pytest.mark.parametrize("edit", [("Paris.", "Xaris."), ('"user"', '"uzer"')],
                         ids=["text", "role"])
def test_a_corrupt_conversation_is_refused_by_name(edit: tuple[str, str],
                                                   tmp_path: Path) -> None:
    app, ex, state = _app(tmp_path, api_keys=("ka", "kb"))
    a, b = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}
    with TestClient(app) as http:
        first = [{"role": "user", "content": "Capital of France? Paris."}]
        r = http.post(CHAT, headers=a, json={"messages": first, "max_tokens": 2})
        cid = r.json()["conversation_id"]
        answer = r.json()["choices"][0]["message"]["content"]
        other = http.post(CHAT, headers=a, json={
            "messages": [{"role": "user", "content": "Other"}], "max_tokens": 2}).json()
        _edit_row(tmp_path / "conv.db", cid, *edit)
        runs = len(ex.seen)
        resent = first + [{"role": "assistant", "content": answer},
                          {"role": "user", "content": "And Spain?"}]
        for body in ({"messages": [{"role": "user", "content": "And Spain?"}],
                      "conversation_id": cid, "max_tokens": 2},
                     {"messages": resent, "max_tokens": 2},
                     {"messages": resent, "max_tokens": 2, "stream": True}):
            r = http.post(CHAT, headers=a, json=body)
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert err["code"] == "conversation_corrupt" and cid in err["message"]
        got = http.get(f"/v1/conversations/{cid}", headers=a)
        assert got.status_code == 500 and got.json()["error"]["code"] == "conversation_corrupt"
        assert len(ex.seen) == runs  # nothing of it reached the engine
        # another tenant cannot tell it from an unknown id
        assert http.get(f"/v1/conversations/{cid}", headers=b).status_code == 404
        assert http.delete(f"/v1/conversations/{cid}", headers=b).status_code == 404
        # the other conversation is served; the owner can delete the corrupt one
        r = http.post(CHAT, headers=a, json={
            "messages": [{"role": "user", "content": "Go on"}],
            "conversation_id": other["conversation_id"], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["pensieve"]["stored"] is True
        assert http.delete(f"/v1/conversations/{cid}", headers=a).json()["deleted"] is True
        assert http.get(f"/v1/conversations/{cid}", headers=a).status_code == 404
