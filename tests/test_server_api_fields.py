"""The request fields of issue 46 through the HTTP API (the official `openai` client where it
fits), over the scripted engine: the sampling fields reach the engine, bounds and unknown
fields are 400s naming the field, ``min_tokens`` holds stop strings back, the default
``max_tokens`` is the rest of the context, ``chat_template_kwargs`` reach the template, and the
endpoints /tokenize, /detokenize, /version, CORS, a public /metrics and model-path aliases."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from server_scripted import build_tokenizer, scripted_app

import pensieve

MSGS = [{"role": "user", "content": "Tell me about memory palaces."}]


@pytest.fixture(scope="module")
def tok() -> Any:
    t = build_tokenizer("chatml")
    t.chat_template += "{% if greeting is defined %}{{ greeting }}{% endif %}"
    return t


def _serve(tok: Any, tmp_path: Path, **kw: Any) -> Iterator[tuple[TestClient, Any, Any]]:
    app, ex = scripted_app(tok, tmp_path / "conv.db", **kw)
    with TestClient(app) as http:
        yield http, ex, openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="k",
                                      http_client=http, max_retries=0)
    app.state.pensieve.engine.shutdown()


@pytest.fixture
def served(tok: Any, tmp_path: Path) -> Iterator[tuple[TestClient, Any, Any]]:
    yield from _serve(tok, tmp_path, model_aliases=("/models/Scripted-1B", "Scripted-1B"),
                      allowed_origins=("http://ui.example",))


def _enc(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def test_sampling_fields_reach_the_engine(tok: Any, served: Any) -> None:
    http, ex, client = served
    ex.script = _enc(tok, " ok then") + [tok.eos_token_id]
    r = client.chat.completions.create(
        model="scripted", messages=MSGS, max_tokens=8, presence_penalty=0.5,
        frequency_penalty=-1.0, logit_bias={"7": 5, "9": -100},
        extra_body={"min_tokens": 2, "min_p": 0.1, "repetition_penalty": 1.3})
    assert r.choices[0].message.content == " ok then"
    (params, hist), = ex.sampled_with.values()
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
            params.min_tokens, params.min_p) == (0.5, -1.0, 1.3, 2, 0.1)
    assert params.logit_bias == ((7, 5.0), (9, -100.0))
    # the processors read the turn's whole context and what it generated
    assert hist.prompt_token_ids == tok.apply_chat_template(
        MSGS, add_generation_prompt=True, tokenize=True, return_dict=False)
    # (the request's own list: by now it holds the whole answer)
    assert hist.output_token_ids == ex.script
    assert hist.eos_token_ids == (tok.eos_token_id,)


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
    ("min_p", 1.5), ("min_tokens", 50), ("logit_bias", {"x": 1}),
    ("logit_bias", {"3": 101}), ("logit_bias", {"999999": 1}),
])
def test_bounds_are_400_naming_the_field(served: Any, field: str, value: Any) -> None:
    http, ex, client = served
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="scripted", messages=MSGS, max_tokens=8,
                                       extra_body={field: value})
    assert field in e.value.body["message"]
    if field != "logit_bias" or value != {"999999": 1}:  # the engine checks the vocabulary
        assert e.value.body["param"] == field


def test_unknown_fields_are_400_and_labels_accepted(tok: Any, served: Any) -> None:
    http, ex, client = served
    for body in ({"use_beam_search": True}, {"foo": 1}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="scripted", messages=MSGS, extra_body=body)
        name = next(iter(body))
        assert e.value.body["param"] == name and e.value.body["code"] == "unknown_parameter"
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "bar": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bar"
    bad_msg = [{"role": "user", "content": "x", "tool_call_id": "t"}]
    r = http.post("/v1/chat/completions", json={"messages": bad_msg})
    assert r.status_code == 400 and "tool_call_id" in r.json()["error"]["message"]
    ex.script = _enc(tok, " fine") + [tok.eos_token_id]
    r2 = client.chat.completions.create(model="scripted", messages=MSGS, max_tokens=4,
                                        user="u-1", metadata={"k": "v"})
    assert r2.choices[0].message.content == " fine"


def test_min_tokens_holds_stop_strings_back(tok: Any, served: Any) -> None:
    http, ex, client = served
    head = _enc(tok, " Sure")
    ex.script = _enc(tok, " Sure thing Sure more") + [tok.eos_token_id]
    r = client.chat.completions.create(model="scripted", messages=MSGS, stop=" Sure",
                                       max_tokens=20)
    assert r.choices[0].message.content == ""
    r = client.chat.completions.create(model="scripted", messages=MSGS, stop=" Sure",
                                       max_tokens=20, extra_body={"min_tokens": len(head) + 1})
    assert r.choices[0].message.content == " Sure thing"


def test_default_max_tokens_is_the_rest_of_the_context(tok: Any, served: Any) -> None:
    http, ex, client = served
    ex.script = []  # never ends by itself
    r = client.completions.create(model="scripted", prompt=[5, 6, 7])
    room = http.app.state.pensieve.max_turn_tokens  # the GPU tier holds less than 1024
    assert room == 58 * 8 < 1024
    assert r.usage.completion_tokens == room - 3 and r.choices[0].finish_reason == "length"
    ex.script = []
    r = client.chat.completions.create(model="scripted", messages=MSGS)
    assert r.usage.completion_tokens == room - r.usage.prompt_tokens


def test_chat_template_kwargs_reach_the_template(tok: Any, served: Any) -> None:
    http, ex, client = served
    ex.script = _enc(tok, " ok") + [tok.eos_token_id]
    client.chat.completions.create(model="scripted", messages=MSGS, max_tokens=4,
                                   extra_body={"chat_template_kwargs": {"greeting": "Hello"}})
    assert tok.decode([t for t in ex.seen[-1] if t is not None]).endswith("Hello")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="scripted", messages=MSGS, max_tokens=4,
                                       extra_body={"chat_template_kwargs": {"tokenize": True}})
    assert e.value.body["param"] == "chat_template_kwargs"


def test_tokenize_detokenize_version(tok: Any, served: Any) -> None:
    http, ex, client = served
    r = http.post("/tokenize", json={"prompt": "Hello there"}).json()
    assert r["tokens"] == list(tok.encode("Hello there")) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 1024
    r = http.post("/tokenize", json={"messages": MSGS, "model": "scripted"}).json()
    assert r["tokens"] == tok.apply_chat_template(MSGS, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)
    r = http.post("/tokenize", json={"messages": MSGS, "add_generation_prompt": False}).json()
    assert r["tokens"] == tok.apply_chat_template(MSGS, tokenize=True, return_dict=False)
    ids = _enc(tok, "Memory palaces")
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "Memory palaces"}
    for bad in ({"tokens": [10**9]}, {"tokens": ["a"]}):
        assert http.post("/detokenize", json=bad).status_code == 400
    assert http.post("/tokenize", json={}).status_code == 400
    assert http.post("/tokenize", json={"prompt": "x", "model": "nope"}).status_code == 404
    assert http.get("/version").json() == {"version": pensieve.__version__}


def test_model_path_is_an_alias(tok: Any, served: Any) -> None:
    http, ex, client = served
    ex.script = _enc(tok, " ok") + [tok.eos_token_id]
    for name in ("/models/Scripted-1B", "Scripted-1B"):
        r = client.chat.completions.create(model=name, messages=MSGS, max_tokens=4)
        assert r.choices[0].message.content == " ok"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="/models/Other", messages=MSGS, max_tokens=4)


def test_cors(served: Any) -> None:
    http, ex, client = served
    pre = {"origin": "http://ui.example", "access-control-request-method": "POST"}
    r = http.options("/v1/chat/completions", headers=pre)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://ui.example"
    r = http.options("/v1/chat/completions", headers={**pre, "origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("public", [False, True])
def test_metrics_public(tok: Any, tmp_path: Path, public: bool) -> None:
    for http, _, _ in _serve(tok, tmp_path, api_keys=("secret",), metrics_public=public,
                             metrics_key="ops"):
        assert http.get("/metrics").status_code == (200 if public else 401)
        assert http.get("/metrics", headers={"authorization": "Bearer ops"}).status_code == 200
        # a tenant's key reads every tenant's counters only when they are public
        assert http.get("/metrics", headers={"authorization": "Bearer secret"}).status_code \
            == (200 if public else 403)
        assert http.get("/v1/models").status_code == 401  # only /metrics opens


def _prompt_tokens_computed(http: TestClient) -> float:
    """pensieve_prompt_tokens{source=new|recomputed} summed: context tokens computed."""
    total = 0.0
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("pensieve_prompt_tokens_total{") and (
                'source="new"' in line or 'source="recomputed"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_n_choices_share_the_prompt(tok: Any, served: Any) -> None:
    http, ex, client = served
    answers = [" zero", " one", " two", " three"]
    ex.scripts = {100 + i: _enc(tok, a) + [tok.eos_token_id] for i, a in enumerate(answers)}
    before, runs = _prompt_tokens_computed(http), len(ex.computed)
    r = client.chat.completions.create(model="scripted", messages=MSGS, n=4, seed=100,
                                       max_tokens=8)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.message.content for c in r.choices] == answers  # choice i: seed + i
    prompt = r.usage.prompt_tokens
    # the prompt is computed once: each later choice recomputes its last token only
    assert ex.computed[runs:] == [prompt, 1, 1, 1]
    assert _prompt_tokens_computed(http) - before == prompt + 3
    assert r.usage.completion_tokens == sum(len(_enc(tok, a)) + 1 for a in answers)
    # the conversation continues with choice 0: its KV is reused by the next turn (which,
    # re-sending the history without an id, is a conversation of its own)
    msgs = MSGS + [{"role": "assistant", "content": " zero"}, {"role": "user", "content": "?"}]
    ex.scripts, ex.script = {}, _enc(tok, " ok") + [tok.eos_token_id]
    r2 = client.chat.completions.create(model="scripted", messages=msgs, max_tokens=4)
    assert r2.model_extra["conversation_id"] != r.model_extra["conversation_id"]
    assert r2.usage.prompt_tokens_details.cached_tokens >= prompt
    stored = http.get(f"/v1/conversations/{r2.model_extra['conversation_id']}").json()
    assert [m["content"] for m in stored["messages"]][1:3] == [" zero", "?"]


def test_n_choices_stream_per_index(tok: Any, served: Any) -> None:
    http, ex, client = served
    answers = [" zero", " one", " two"]
    ex.scripts = {7 + i: _enc(tok, a) + [tok.eos_token_id] for i, a in enumerate(answers)}
    texts, finish = ["", "", ""], [None, None, None]
    usage = None
    for chunk in client.chat.completions.create(model="scripted", messages=MSGS, n=3, seed=7,
                                                max_tokens=8, stream=True,
                                                stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
        usage = chunk.usage or usage
    assert texts == answers and finish == ["stop"] * 3
    assert usage is not None and usage.completion_tokens == sum(
        len(_enc(tok, a)) + 1 for a in answers)
    # completions without a conversation: a temporary one, dropped after
    ex.scripts = {}
    ex.script = _enc(tok, " ok") + [tok.eos_token_id]
    runs = len(ex.computed)
    r = client.completions.create(model="scripted", prompt=[5, 6, 7, 8], n=2, max_tokens=4)
    assert [c.text for c in r.choices] == [" ok", " ok"] and ex.computed[runs:] == [4, 1]
    r = client.completions.create(model="scripted", prompt=[5, 6, 7, 8], n=2, max_tokens=4)
    assert ex.computed[runs + 2:] == [4, 1]  # nothing kept from the last request
