"""Regression tests of the audit of 2026-12-06 (issue 60, "Faults"), over the scripted engine
(the real scheduler and cache, an executor that answers from a script): sampling ranges,
conversation ids that disagree or are empty, a conversation id sent with the whole history,
tools whose schemas use ``$ref``, ``/metrics`` for the operator and ``/v1/usage`` per tenant,
and ``GET /v1/models/{id}``. Faults 1 and 2: test_server_stateless.py and
test_server_grammar_compile.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from server_scripted import build_tokenizer, scripted_app

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Tell me about memory palaces."}]


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tokenizer("chatml")


def _serve(tok: Any, tmp_path: Path, **kw: Any) -> Iterator[tuple[TestClient, Any, Any]]:
    app, ex = scripted_app(tok, tmp_path / "conv.db", **kw)
    with TestClient(app) as http:
        yield http, ex, openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="k",
                                      http_client=http, max_retries=0)
    app.state.pensieve.engine.shutdown()


@pytest.fixture
def served(tok: Any, tmp_path: Path) -> Iterator[tuple[TestClient, Any, Any]]:
    yield from _serve(tok, tmp_path)


def _enc(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


# ---------------------------------------------------------------- 5: sampling ranges
@pytest.mark.parametrize("field,value", [
    ("repetition_penalty", 1e-40), ("repetition_penalty", 1e6), ("presence_penalty", 2.01),
    ("frequency_penalty", -1e9), ("min_p", 1.5), ("temperature", 2.5), ("top_p", 0),
])
def test_sampling_values_out_of_range_are_400_naming_the_field(served: Any, field: str,
                                                                value: float) -> None:
    http, ex, _ = served
    r = http.post(CHAT, json={"messages": MSGS, "max_tokens": 4, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err
    assert not ex.sampled_with  # nothing reached the engine


def test_a_tiny_temperature_runs_as_vllms_floor(tok: Any, served: Any) -> None:
    """temperature 1e-40 divided the logits into infinities; it runs as 0.01, as vLLM."""
    http, ex, _ = served
    ex.script = _enc(tok, " ok") + [tok.eos_token_id]
    r = http.post(CHAT, json={"messages": MSGS, "max_tokens": 4, "temperature": 1e-40})
    assert r.status_code == 200, r.text
    (params, _), = ex.sampled_with.values()
    assert params.temperature == 0.01


# ---------------------------------------------------------------- 7: tracebacks, ids
class _RaisesOnPoison:
    """The scripted executor, raising for a step that holds the poison token."""

    def __init__(self, inner: Any, poison: int) -> None:
        self.inner, self.poison = inner, poison

    @property
    def tiers(self) -> Any:
        return self.inner.tiers

    def execute(self, sched: Any) -> Any:
        if any(self.poison in r.token_ids for s in sched.requests for r in s.ranges):
            _failing_kernel()
        return self.inner.execute(sched)

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def shutdown(self) -> None:
        pass


def _failing_kernel() -> None:
    raise RuntimeError("the kernel failed")


def test_a_failed_step_logs_its_traceback(tok: Any, tmp_path: Path,
                                          caplog: pytest.LogCaptureFixture) -> None:
    """The step's exception used to be logged as one line, without where it was raised."""
    poison = _enc(tok, "\u00a7")[0]
    for http, ex, _ in _serve(tok, tmp_path, wrap=lambda inner: _RaisesOnPoison(inner, poison)):
        ex.script = _enc(tok, " ok") + [tok.eos_token_id]
        r = http.post(CHAT, json={"messages": [{"role": "user", "content": "\u00a7"}],
                                  "max_tokens": 4})
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error", r.text
    logged = "\n".join(caplog.text.splitlines())
    assert "Traceback" in logged and "_failing_kernel" in logged, logged[-3000:]


@pytest.mark.parametrize("body_id,header_id,code", [
    ("conv-a", "conv-b", "conversation_id_mismatch"), ("", None, "invalid_conversation_id"),
    (None, "", "invalid_conversation_id"), ("  ", None, "invalid_conversation_id"),
])
@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
def test_conversation_ids_that_disagree_or_are_empty_are_400(
        tok: Any, served: Any, path: str, body_id: str | None, header_id: str | None,
        code: str) -> None:
    http, ex, _ = served
    ex.script = _enc(tok, " ok") + [tok.eos_token_id]
    r = http.post(CHAT, json={"messages": MSGS, "max_tokens": 4})
    before = http.app.state.pensieve.store.count()
    body: dict[str, Any] = ({"messages": MSGS} if path == CHAT else {"prompt": "Hi"})
    body["max_tokens"] = 4
    if body_id is not None:
        body["conversation_id"] = body_id
    headers = {} if header_id is None else {"x-conversation-id": header_id}
    r = http.post(path, json=body, headers=headers)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("conversation_id", code), err
    assert http.app.state.pensieve.store.count() == before  # no conversation started


def test_the_same_id_in_body_and_header_is_fine(tok: Any, served: Any) -> None:
    http, ex, _ = served
    ex.script = _enc(tok, " ok") + [tok.eos_token_id]
    cid = http.post(CHAT, json={"messages": MSGS, "max_tokens": 4}).json()["conversation_id"]
    r = http.post(CHAT, headers={"x-conversation-id": cid}, json={
        "messages": [{"role": "user", "content": "More."}], "max_tokens": 4,
        "conversation_id": cid})
    assert r.status_code == 200 and r.json()["conversation_id"] == cid, r.text


# ---------------------------------------------------------------- 4: id with the history
def test_an_id_sent_with_the_whole_history_does_not_double_it(tok: Any, served: Any) -> None:
    """The stored messages re-sent beside the conversation's id are recognised as its
    history: the model's context and the store hold them once."""
    http, ex, _ = served
    ex.script = _enc(tok, " ok") + [tok.eos_token_id]
    r = http.post(CHAT, json={"messages": MSGS, "max_tokens": 4}).json()
    cid = r["conversation_id"]
    history = MSGS + [{"role": "assistant", "content": " ok"}]
    more = [{"role": "user", "content": "And then?"}]
    r2 = http.post(CHAT, json={"messages": history + more, "max_tokens": 4,
                               "conversation_id": cid})
    assert r2.status_code == 200, r2.text
    want = history + more + [{"role": "assistant", "content": " ok"}]
    conv = http.get(f"/v1/conversations/{cid}").json()
    assert conv["messages"] == want
    assert ex.seen[-1] == tok.apply_chat_template(history + more, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)
    # the history alone, with its id, asks for nothing new
    r3 = http.post(CHAT, json={"messages": want, "conversation_id": cid})
    assert r3.status_code == 400 and r3.json()["error"]["param"] == "messages", r3.text


# ---------------------------------------------------------------- 6: $ref in tool schemas
def _pydantic_tool() -> dict[str, Any]:
    """A tool whose parameters are what Pydantic writes for a nested model: a ``$ref`` to
    ``#/$defs/Item``."""
    from pydantic import BaseModel

    class Item(BaseModel):
        sku: str
        count: int

    class Order(BaseModel):
        item: Item
        note: str | None = None

    return {"type": "function", "function": {"name": "order",
                                             "parameters": Order.model_json_schema()}}


def _legacy_tool() -> dict[str, Any]:
    """The same with ``#/definitions`` (older generators)."""
    return {"type": "function", "function": {"name": "order", "parameters": {
        "type": "object", "properties": {"item": {"$ref": "#/definitions/Item"}},
        "required": ["item"], "definitions": {"Item": {
            "type": "object", "properties": {"sku": {"type": "string"},
                                             "count": {"type": "integer"}},
            "required": ["sku", "count"]}}}}}


@pytest.mark.parametrize("tool", [_pydantic_tool(), _legacy_tool()], ids=["defs", "definitions"])
@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "order"}}],
                         ids=["required", "named"])
def test_tool_schemas_with_refs_constrain_the_call(tok: Any, served: Any, tool: dict[str, Any],
                                                   choice: Any) -> None:
    """A forced call of a tool whose schema has ``$ref`` used to be a 400 (the reference was
    resolved against the call's wrapper schema); the grammar now admits calls that follow
    the referenced definition and only those. (Checked where the server checks a request's
    constraint: the scripted engine's tiers are too small for the tools' system prompt.)"""
    import xgrammar as xgr

    from pensieve.server.protocol import ChatCompletionRequest
    from pensieve.server.structured import constraint

    http, _, _ = served
    state = http.app.state.pensieve
    body = ChatCompletionRequest(messages=MSGS, tools=[tool], tool_choice=choice)
    wanted = constraint(state, body)
    assert wanted.grammar is not None and wanted.tool_format == "hermes"
    compiled = state.renderer.grammar_compiler().compile(wanted.grammar)
    call = '<tool_call>\n{"name": "order", "arguments": {"item": {"sku": "a1", "count": 2}}}' \
           '\n</tool_call>'
    assert xgr.GrammarMatcher(compiled).accept_string(call)
    wrong = call.replace('"count": 2', '"count": "two"')  # Item.count is an integer
    assert not xgr.GrammarMatcher(compiled).accept_string(wrong)


# ---------------------------------------------------------------- 8: /metrics, /v1/usage
def test_metrics_are_the_operators_and_usage_each_tenants(tok: Any, tmp_path: Path) -> None:
    """A tenant's key used to read ``/metrics``, every tenant's traffic; it now reads its own
    at ``/v1/usage``, and ``/metrics`` takes the operator's key."""
    for http, ex, _ in _serve(tok, tmp_path, api_keys=("key-a", "key-b"), metrics_key="ops"):
        a, b = ({"authorization": f"Bearer {k}"} for k in ("key-a", "key-b"))
        ex.script = _enc(tok, " ok then") + [tok.eos_token_id]
        r = http.post(CHAT, headers=a, json={"messages": MSGS, "max_tokens": 8})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        for key in (a, b):
            m = http.get("/metrics", headers=key)
            assert m.status_code == 403 and m.json()["error"]["code"] == "operator_only", m.text
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers={"authorization": "Bearer ops"}).status_code == 200
        mine = http.get("/v1/usage", headers=a).json()
        assert mine == {"object": "usage", "requests": 1,
                        "prompt_tokens": usage["prompt_tokens"],
                        "cached_prompt_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                        "completion_tokens": usage["completion_tokens"]}
        assert http.get("/v1/usage", headers=b).json()["requests"] == 0
        assert http.get("/v1/usage").status_code == 401
        assert http.get("/v1/usage", headers={"authorization": "Bearer ops"}).status_code == 401


def test_metrics_public_opens_metrics_only(tok: Any, tmp_path: Path) -> None:
    for http, _, _ in _serve(tok, tmp_path, api_keys=("key-a",), metrics_public=True):
        assert http.get("/metrics").status_code == 200
        assert http.get("/v1/usage").status_code == 401


# ---------------------------------------------------------------- first hour, item 7
def test_models_retrieve(served: Any) -> None:
    """``client.models.retrieve`` used to 404."""
    http, _, client = served
    m = client.models.retrieve("scripted")
    assert (m.id, m.object, m.owned_by) == ("scripted", "model", "pensieve")
    assert http.get("/v1/models/scripted").json() == http.get("/v1/models").json()["data"][0]
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert (e.value.body["param"], e.value.body["code"]) == ("model", "model_not_found")


@pytest.mark.parametrize("body,param,code", [
    ({"messages": [{"role": "user", "content": "x " * 600}], "max_tokens": 4}, "messages",
     "context_length_exceeded"),
    ({"messages": MSGS, "max_tokens": 700}, "messages", "context_length_exceeded"),
    ({"messages": MSGS, "max_tokens": 4, "logit_bias": {"999999": 1}}, "logit_bias",
     "invalid_token_id"),
    ({"messages": MSGS, "max_tokens": "many"}, "max_tokens", "int_parsing"),
    ({"messages": MSGS, "temperature": 3}, "temperature", "less_than_equal"),
])
def test_errors_name_the_field_and_a_code(served: Any, body: dict[str, Any], param: str,
                                          code: str) -> None:
    """Errors whose field is known used to carry ``param: null`` or ``code: null``."""
    http, _, _ = served
    r = http.post(CHAT, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code), err


def test_completion_errors_name_the_prompt(served: Any) -> None:
    http, _, _ = served
    r = http.post("/v1/completions", json={"prompt": [10**6], "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("prompt", "invalid_token_id"), err
