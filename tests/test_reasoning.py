"""``reasoning_content`` of thinking models (``<think>`` tags, vLLM's Qwen3 parser): the whole
answer's split, the streamed split at every chunk boundary, and through the API with a
tokenizer whose template and vocabulary have the tags (one without them gets no split)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from server_scripted import build_tokenizer, scripted_app

from pensieve.server.reasoning import ReasoningStream, split_reasoning, thinks

ANSWERS = ["<think>Let me see.</think>\n\nThe answer.", "\n<think>a < b </thi</think>c",
           "Plain answer.", "<think>unfinished", "<thin", "", "</think>after"]


def test_split_whole_answers() -> None:
    assert split_reasoning(ANSWERS[0]) == ("Let me see.", "\n\nThe answer.")
    assert split_reasoning(ANSWERS[1]) == ("a < b </thi", "c")
    assert split_reasoning("Plain answer.") == (None, "Plain answer.")
    assert split_reasoning("</think>after") == ("", "after")  # the start tag in the prompt


@pytest.mark.parametrize("text", ANSWERS)
def test_stream_split_at_every_boundary(text: str) -> None:
    for step in (1, 2, 3, 7):
        rs = ReasoningStream()
        parts = [rs.feed(text[i:i + step]) for i in range(0, len(text), step)] + [rs.flush()]
        reasoning = "".join(r for r, _ in parts)
        content = "".join(c for _, c in parts)
        if text.lstrip().startswith("<think>"):
            want_r, want_c = split_reasoning(text)
            if want_r is None:  # never closed: streamed as reasoning (vLLM's streaming)
                want_r, want_c = text.lstrip()[len("<think>"):], ""
            assert (reasoning, content) == (want_r, want_c)
        else:
            assert (reasoning, content) == ("", text)


@pytest.fixture(scope="module")
def think_tok() -> Any:
    t = build_tokenizer("chatml")
    t.add_tokens(["<think>", "</think>"])
    t.chat_template = t.chat_template.replace(
        "{{ '<|im_start|>assistant\n' }}",
        "{{ '<|im_start|>assistant\n' }}{% if enable_thinking is defined and not "
        "enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}")
    return t


def test_api_splits_reasoning(think_tok: Any, tmp_path: Path) -> None:
    assert thinks(think_tok) and not thinks(build_tokenizer("chatml"))
    app, ex = scripted_app(think_tok, tmp_path / "c.db")
    msgs = [{"role": "user", "content": "What is it?"}]
    enc = lambda s: list(think_tok.encode(s, add_special_tokens=False))  # noqa: E731
    with TestClient(app) as http:
        client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="k",
                               http_client=http, max_retries=0)
        ex.script = enc(ANSWERS[0]) + [think_tok.eos_token_id]
        r = client.chat.completions.create(model="scripted", messages=msgs, max_tokens=40)
        m = r.choices[0].message
        assert m.content == "\n\nThe answer." and m.model_extra["reasoning_content"] == (
            "Let me see.")
        reasoning = content = ""
        cids = {r.model_extra["conversation_id"]}
        for chunk in client.chat.completions.create(model="scripted", messages=msgs,
                                                    max_tokens=40, stream=True):
            cids.add(chunk.model_extra["conversation_id"])
            d = chunk.choices[0].delta
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            content += d.content or ""
        assert (reasoning, content) == ("Let me see.", "\n\nThe answer.")
        # the client re-sends the content: its history is recognised (a new conversation
        # over one of the two that stored these messages), its KV reused
        msgs2 = msgs + [{"role": "assistant", "content": m.content},
                        {"role": "user", "content": "Sure?"}]
        ex.script = enc("Yes.") + [think_tok.eos_token_id]
        r2 = client.chat.completions.create(
            model="scripted", messages=msgs2, max_tokens=8,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert r2.model_extra["conversation_id"] not in cids
        assert r2.usage.prompt_tokens_details.cached_tokens > 0
        assert r2.choices[0].message.content == "Yes."
        assert r2.choices[0].message.model_extra["reasoning_content"] is None
        assert think_tok.decode([t for t in ex.seen[-1] if t is not None]).endswith(
            "<think>\n\n</think>\n\n")
    app.state.pensieve.engine.shutdown()
