"""vLLM's side doors on the scripted server: ``GET /tokenizer_info`` gives the tokenizer's
special tokens and chat template, ``HEAD /metrics`` is a 200, the ``vllm:`` aliases carry the
same values as their ``pensieve_`` metrics, and a 4xx's reason reaches the server's log."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from server_scripted import build_tokenizer, scripted_app

MSGS = [{"role": "user", "content": "Tell me about memory palaces."}]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[TestClient, Any, Any, Any]]:
    tok = build_tokenizer("chatml")
    app, ex = scripted_app(tok, tmp_path / "conv.db")
    with TestClient(app) as http:
        yield http, ex, tok, openai.OpenAI(base_url=str(http.base_url) + "/v1",
                                           api_key="k", http_client=http, max_retries=0)
    app.state.pensieve.engine.shutdown()


def _value(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_tokenizer_info_head_metrics_and_aliases(served: Any) -> None:
    http, ex, tok, client = served
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    assert info["tokenizer_class"] == type(tok).__name__ and info["vocab_size"] == len(tok)
    assert http.head("/metrics").status_code == 200
    ex.script = list(tok.encode(" ok then", add_special_tokens=False)) + [tok.eos_token_id]
    script = list(ex.script)
    client.chat.completions.create(model="scripted", messages=MSGS, max_tokens=8)
    text = http.get("/metrics").text
    for ours, theirs in (("pensieve_generation_tokens_total", "vllm:generation_tokens_total"),
                         ("pensieve_requests_running", "vllm:num_requests_running"),
                         ("pensieve_time_to_first_token_seconds_count",
                          "vllm:time_to_first_token_seconds_count"),
                         ('pensieve_kv_cache_usage_ratio{tier="gpu"}',
                          "vllm:kv_cache_usage_perc")):
        assert _value(text, theirs) == _value(text, ours), theirs
    assert _value(text, "vllm:generation_tokens_total") == len(script)  # the end's included


def test_a_4xx_reason_is_logged(served: Any, caplog: pytest.LogCaptureFixture) -> None:
    http, _, _, _ = served
    with caplog.at_level(logging.INFO, logger="pensieve.server"):
        r = http.post("/v1/chat/completions", json={"messages": MSGS, "frobnicate": 1})
        assert r.status_code == 400
        r = http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 0})
        assert r.status_code == 400
    logged = caplog.text
    assert "POST /v1/chat/completions -> 400 unknown_parameter (param frobnicate)" in logged
    assert "(param max_tokens)" in logged
