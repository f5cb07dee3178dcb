"""The OpenAI/vLLM surface, in process over the scripted engine and driven by the official
`openai` client: stop strings of any length (streamed and not, trimmed, held back across
chunks), SSE line separators escaped, 400 for what is not implemented, 404 for an unknown
model, cached_tokens, the metrics and /openapi.json as the server behaves, body-size limit."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from server_scripted import build_tokenizer, scripted_app

from pensieve.options import checked_max_model_len
from pensieve.server.model_defaults import generation_defaults
from pensieve.server.text import IncrementalDetokenizer, StopStrings


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tokenizer("chatml")


@pytest.fixture
def served(tok: Any, tmp_path: Path) -> Iterator[tuple[TestClient, Any, openai.OpenAI]]:
    app, ex = scripted_app(tok, tmp_path / "conv.db", served_model_names=("a", "b"),
                           max_request_bytes=4096)
    with TestClient(app) as http:
        yield http, ex, openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="k",
                                      http_client=http, max_retries=0)
    app.state.pensieve.engine.shutdown()


def _enc(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def test_stop_strings_of_any_length(tok: Any, served: Any) -> None:
    http, ex, client = served
    msgs = [{"role": "user", "content": "Tell me about memory palaces."}]
    ex.script = _enc(tok, " Hello there\n\nUser: more") + [tok.eos_token_id]
    r = client.chat.completions.create(model="a", messages=msgs, stop=["User:", "\n\n"],
                                       max_tokens=40)
    assert r.choices[0].message.content == " Hello there"
    assert r.choices[0].finish_reason == "stop"
    text, finishes = "", []
    for chunk in client.chat.completions.create(model="a", messages=msgs, stop=["User:"],
                                                max_tokens=40, stream=True):
        text += chunk.choices[0].delta.content or ""
        finishes.append(chunk.choices[0].finish_reason)
        assert "User" not in text  # a partial match is held back, never sent
    assert text == " Hello there\n\n" and finishes[-1] == "stop"
    # no stop matches: the held-back "Us" is released at the end
    ex.script = _enc(tok, " Hi Us") + [tok.eos_token_id]
    r = client.chat.completions.create(model="a", messages=msgs, stop=["User:"], max_tokens=40)
    assert r.choices[0].message.content == " Hi Us"
    # a special token as a stop string stops on its id (it never shows in the text)
    ex.script = _enc(tok, " One") + [tok.convert_tokens_to_ids("<|im_start|>")] + _enc(tok, "x")
    r = client.chat.completions.create(model="a", messages=msgs, stop="<|im_start|>",
                                       max_tokens=40)
    assert r.choices[0].message.content == " One" and r.choices[0].finish_reason == "stop"


def test_conversation_after_a_stop_string_is_still_exact(tok: Any, served: Any) -> None:
    http, ex, client = served
    msgs = [{"role": "user", "content": "Hi"}]
    ex.script = _enc(tok, " Sure. END more words") + [tok.eos_token_id]
    r = client.chat.completions.create(model="a", messages=msgs, stop=" END", max_tokens=40)
    assert r.choices[0].message.content == " Sure."
    msgs += [{"role": "assistant", "content": " Sure."}, {"role": "user", "content": "And?"}]
    ex.script = _enc(tok, " Done.") + [tok.eos_token_id]
    r2 = client.chat.completions.create(model="a", messages=msgs, max_tokens=40)
    assert r2.model_extra["conversation_id"] != r.model_extra["conversation_id"]  # a new one
    assert ex.seen[-1] == tok.apply_chat_template(msgs, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)
    assert r2.usage.prompt_tokens_details.cached_tokens > 0


def test_stop_strings_unit() -> None:
    s = StopStrings(["User:", "\n\n"])
    out = [s.feed(x) for x in ["Hello ", "Us", "e", "r? no\n", "\nrest"]]
    assert out == ["Hello ", "", "", "User? no", ""] and s.stopped and s.text == "Hello User? no"
    s = StopStrings(["abcabd"])
    assert s.feed("xxabcab") == "xx" and s.feed("c") == "abc" and s.flush() == "abc"
    assert s.text == "xxabcabc" and not s.stopped
    s = StopStrings([])
    assert s.feed("a\n\n") == "a\n\n" and s.flush() == ""


def test_incremental_detokenizer_equals_full_decode(tok: Any) -> None:
    text = "Grüße, 世界! 😀 ok\u2028end"
    ids = _enc(tok, text)
    d = IncrementalDetokenizer(tok)
    pieces = [d.add(t) for t in ids] + [d.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)  # half a UTF-8 sequence waits


def test_sse_escapes_line_separators(tok: Any, served: Any) -> None:
    http, ex, client = served
    text = " a\u2028b\u2029c\x85d"
    ex.script = _enc(tok, text) + [tok.eos_token_id]
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 40}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        raw = r.read().decode()
    for ch in "\u2028\u2029\x85":
        assert ch not in raw
    got = "".join(json.loads(line[6:])["choices"][0]["delta"]["content"]
                  for line in raw.split("\n")
                  if line.startswith("data: {") and json.loads(line[6:])["choices"])
    assert got == text
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="b", messages=[{"role": "user", "content": "y"}], max_tokens=40, stream=True))
    assert streamed == text


@pytest.mark.parametrize("field,value", [
    ("best_of", 3), ("echo", True), ("guided_json", {"type": "object"}),
    ("structured_outputs", {"json": {}})])
def test_unsupported_fields_are_400(served: Any, field: str, value: Any) -> None:
    http, ex, client = served
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="a", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2, extra_body={field: value})
    assert e.value.body["param"] == field and "not supported" in e.value.body["message"]


def test_inert_values_unknown_model_and_names(tok: Any, served: Any) -> None:
    http, ex, client = served
    ex.script = _enc(tok, " ok") + [tok.eos_token_id]
    r = client.chat.completions.create(
        model="b", messages=[{"role": "user", "content": "x"}], max_tokens=4,
        presence_penalty=0, frequency_penalty=0.0, response_format={"type": "text"})
    assert r.choices[0].message.content == " ok" and r.model == "b"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found"
    assert [m.id for m in client.models.list().data] == ["a", "b"]


def test_body_limit_is_413(served: Any) -> None:
    http, ex, client = served
    big = {"messages": [{"role": "user", "content": "x" * 5000}]}
    r = http.post("/v1/chat/completions", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}]}'

    r = http.post("/v1/chat/completions", content=chunks(),
                  headers={"content-type": "application/json"})
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]


def test_openapi_metrics_and_health(tok: Any, served: Any) -> None:
    http, ex, client = served
    ex.script = _enc(tok, " one two three") + [tok.eos_token_id]
    client.chat.completions.create(model="a", messages=[{"role": "user", "content": "m"}],
                                   max_tokens=40)
    doc = http.get("/openapi.json").json()
    assert "422" not in json.dumps(doc["paths"])
    assert doc["paths"]["/v1/chat/completions"]["post"]["responses"]["400"]
    assert "text/plain" in json.dumps(doc["paths"]["/metrics"]["get"]["responses"]["200"])
    metrics = http.get("/metrics").text
    n = len(ex.script)
    for name in (f"pensieve_generation_tokens_total {n}.0",
                 "pensieve_time_per_output_token_seconds_count 1.0",
                 f"pensieve_inter_token_latency_seconds_count {n - 1}.0",
                 'pensieve_kv_cache_usage_ratio{tier="gpu"}', "pensieve_requests_queued 0.0"):
        assert name in metrics, name
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["queued"] == 0


def test_model_defaults(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [2, 7], "temperature": 0.6, "top_p": 0.9, "do_sample": True}))
    assert generation_defaults(str(tmp_path)) == ([2, 7], {"temperature": 0.6, "top_p": 0.9})
    assert generation_defaults(None) == ([], {})

    class Cfg:
        max_position_embeddings = 2048

    assert checked_max_model_len(None, Cfg()) == 2048
    assert checked_max_model_len(1024, Cfg()) == 1024
    with pytest.raises(SystemExit, match="max_position_embeddings"):
        checked_max_model_len(4096, Cfg())


def test_generation_config_eos_stops_turns(tok: Any, tmp_path: Path) -> None:
    extra = tok.convert_tokens_to_ids("<|endoftext|>")
    app, ex = scripted_app(tok, tmp_path / "c.db", extra_stop_token_ids=(extra,))
    with TestClient(app) as http:
        ex.script = _enc(tok, " a b") + [extra] + _enc(tok, " c")
        r = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 20})
        assert r.json()["choices"][0]["message"]["content"] == " a b"
        assert r.json()["choices"][0]["finish_reason"] == "stop"
    app.state.pensieve.engine.shutdown()
