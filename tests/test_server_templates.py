"""Exact conversations: at every turn the model is fed exactly
``apply_chat_template(messages, add_generation_prompt=True)``, for the ChatML, Llama-2, Llama-3
and Mistral templates, whether the client re-sends the history or names the conversation,
over answers that end on EOS, on length, on text that re-tokenizes differently, and with
whitespace a template trims. The KV each turn attends to is read back slot by slot from the
cache (``server_scripted``), and earlier turns' KV is reused, not recomputed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from server_scripted import build_tokenizer, scripted_app


def _template_ids(tok: Any, msgs: list[dict[str, str]]) -> list[int]:
    out = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def _answers(tok: Any) -> list[tuple[list[int], int, str]]:
    """(scripted tokens, max_tokens, expected finish_reason) of the five turns."""
    eos = tok.eos_token_id
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    split = [tok.convert_tokens_to_ids(c) for c in "Sure!"]  # one token per letter
    assert split != enc("Sure!")  # the text re-tokenizes differently
    trailing = enc(" Okay.  \n")
    return [(enc(" Hello there, how can I help you today?") + [eos], 64, "stop"),
            (enc("Memory palaces are a way to remember."), 4, "length"),
            (split + [eos], 64, "stop"),
            (trailing, len(trailing), "length"),
            (enc("Bye.") + [eos], 64, "stop")]


@pytest.mark.parametrize("mode", ["resend", "conversation_id"])
@pytest.mark.parametrize("template", ["chatml", "llama2", "llama3", "mistral"])
def test_every_turn_feeds_exactly_the_chat_template(template: str, mode: str,
                                                     tmp_path: Path) -> None:
    tok = build_tokenizer(template)
    app, eng = scripted_app(tok, tmp_path / "conv.db")
    msgs: list[dict[str, str]] = []
    if template != "mistral":  # its template has no system role
        msgs.append({"role": "system", "content": "You are a helpful assistant."})
    users = ["Tell me about memory palaces.", "Why?", "What else?", "Thanks, that is all.",
             "Really?"]
    cid = None
    with TestClient(app) as client:
        for k, (script, max_tokens, finish) in enumerate(_answers(tok)):
            msgs.append({"role": "user", "content": users[k]})
            eng.script = script
            body: dict[str, Any] = {"messages": msgs, "max_tokens": max_tokens,
                                    "temperature": 0}
            if mode == "conversation_id" and cid is not None:
                body = {**body, "messages": msgs[-1:], "conversation_id": cid}
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            expect = _template_ids(tok, msgs)
            assert eng.seen[-1] == expect, f"turn {k + 1}"
            assert out["usage"]["prompt_tokens"] == len(expect)
            assert out["choices"][0]["finish_reason"] == finish
            if k > 0:  # re-sent without an id: a new conversation over the last one's KV
                assert (out["conversation_id"] == cid) == (mode == "conversation_id")
                assert out["pensieve"]["cache"]["gpu_hit_tokens"] > 0
                assert eng.computed[-1] < len(expect)  # earlier turns' KV reused
            cid = out["conversation_id"]
            msgs.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})
        stored = client.get(f"/v1/conversations/{cid}").json()
        assert stored["messages"] == msgs
        assert stored["token_ids"][:len(expect)] == expect
    app.state.pensieve.engine.shutdown()


def test_template_error_is_a_400(tmp_path: Path) -> None:
    tok = build_tokenizer("mistral")
    app, _ = scripted_app(tok, tmp_path / "conv.db")
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "messages"
        assert "alternate" in r.json()["error"]["message"]
    app.state.pensieve.engine.shutdown()
