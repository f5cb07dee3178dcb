"""Hostile input to the HTTP API, in process over the scripted engine: invalid Unicode in any
string field, header or path (400 naming the field, never a 500), and out-of-range retention
hints (400 naming the field)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from server_scripted import build_tokenizer, scripted_app


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tokenizer("chatml")


@pytest.fixture
def http(tok: Any, tmp_path: Path) -> Iterator[TestClient]:
    app, ex = scripted_app(tok, tmp_path / "conv.db")
    ex.script = [tok.eos_token_id]
    with TestClient(app) as client:
        yield client
    app.state.pensieve.engine.shutdown()


def _post(http: TestClient, path: str, body: Any, **headers: str) -> Any:
    """POST ``body`` as Python's json writes it (a lone surrogate escaped as ``\\ud800``)."""
    return http.post(path, content=json.dumps(body).encode(),
                     headers={"content-type": "application/json", **headers})


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMP = {"prompt": "hi", "max_tokens": 2}
BAD = "a\ud800b"


@pytest.mark.parametrize(("path", "base", "field", "value"), [
    ("/v1/chat/completions", CHAT, "conversation_id", BAD),
    ("/v1/completions", COMP, "conversation_id", BAD),
    ("/v1/chat/completions", CHAT, "model", BAD),
    ("/v1/completions", COMP, "model", BAD),
    ("/v1/chat/completions", CHAT, "stop", BAD),
    ("/v1/chat/completions", CHAT, "stop", ["x", BAD]),
    ("/v1/completions", COMP, "prompt", BAD),
    ("/v1/chat/completions", CHAT, "user", BAD),
    ("/v1/chat/completions", CHAT, "messages", [{"role": "user", "content": BAD}]),
    ("/v1/chat/completions", CHAT, "messages",
     [{"role": "user", "content": [{"type": "text", "text": BAD}]}]),
    ("/v1/chat/completions", CHAT, "messages", [{"role": "user", "content": "x", "name": BAD}]),
    ("/v1/chat/completions", CHAT, "metadata", {BAD: "x"}),
])
def test_lone_surrogate_is_a_400_naming_the_field(http: TestClient, path: str,
                                                  base: dict[str, Any], field: str,
                                                  value: Any) -> None:
    r = _post(http, path, {**base, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] is not None and err["param"].startswith(field), err
    assert "Unicode" in err["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_odd_header_values_are_never_a_500(http: TestClient, path: str) -> None:
    base = CHAT if path.endswith("chat/completions") else COMP
    for value in (b"\xed\xa0\x80", b"\xff\xfe", "caf\xe9".encode("latin-1")):
        r = http.post(path, content=json.dumps(base).encode(),
                      headers=[(b"content-type", b"application/json"),
                               (b"x-conversation-id", value), (b"authorization", value),
                               (b"idempotency-key", value)])
        assert r.status_code < 500, r.text


def test_conversation_path_with_invalid_utf8_is_not_a_500(http: TestClient) -> None:
    for cid in ("%ED%A0%80", "%FF", "a%00b"):
        r = http.get(f"/v1/conversations/{cid}")
        assert r.status_code in (400, 404), r.text
        r = http.delete(f"/v1/conversations/{cid}")
        assert r.status_code in (400, 404), r.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(("field", "value"), [
    ("retention_priority", float("inf")), ("retention_priority", float("nan")),
    ("retention_priority", 1e300), ("retention_priority", 101), ("priority", float("inf")),
    ("priority", float("nan")), ("priority", 1e300), ("priority", 0.5),
    ("keep_alive_s", float("inf")), ("keep_alive_s", 1e9),
    ("keep_alive_s", 3601), ("temperature", float("nan")), ("top_p", float("nan")),
])
def test_non_finite_or_unbounded_hints_are_a_400(http: TestClient, path: str, field: str,
                                                 value: float) -> None:
    base = CHAT if path.endswith("chat/completions") else COMP
    r = _post(http, path, {**base, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_hints_within_the_bounds_are_accepted(http: TestClient) -> None:
    r = _post(http, "/v1/chat/completions", {**CHAT, "retention_priority": 100,
                                             "keep_alive_s": 3600, "priority": -3})
    assert r.status_code == 200, r.text


def test_bounds_are_server_flags(tok: Any, tmp_path: Path) -> None:
    app, ex = scripted_app(tok, tmp_path / "conv.db", max_priority=2.0, max_keep_alive_s=5.0)
    ex.script = [tok.eos_token_id]
    try:
        with TestClient(app) as client:
            r = _post(client, "/v1/completions", {**COMP, "retention_priority": 2})
            assert r.status_code == 200
            r = _post(client, "/v1/completions", {**COMP, "retention_priority": 3})
            assert r.status_code == 400 and r.json()["error"]["param"] == "retention_priority"
            r = _post(client, "/v1/completions", {**COMP, "keep_alive_s": 6})
            assert r.status_code == 400 and "keep_alive_s" in r.json()["error"]["message"]
    finally:
        app.state.pensieve.engine.shutdown()
