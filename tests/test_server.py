"""`pensieve serve` on localhost, driven by the official openai client (and httpx where the
test needs raw HTTP): conversations both ways, KV reuse, persistence across SIGKILL, bad input,
auth and tenant isolation, client disconnects."""

from __future__ import annotations

import io
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_util import MAX_LEN, Server, run_cache

from pensieve import LLM, SamplingParams


@pytest.fixture(scope="module")
def cache_dir() -> Path:
    return run_cache()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("store") / "conv.db", cache_dir)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with two API keys (tenants key-a and key-b), shared by the tests of auth,
    tenant isolation and prefix sharing (one start instead of three)."""
    srv = Server(tmp_path_factory.mktemp("keyed") / "auth.db", run_cache(), "--api-key",
                 "key-a", "--api-key", "key-b", "--metrics-key", "ops", "--max-model-len", "1024")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(server: Server, cache_dir: Path) -> LLM:
    os.environ["PENSIEVE_CACHE_DIR"] = str(cache_dir)
    return LLM(model="demo", device="cpu", num_gpu_blocks=96, max_num_batched_tokens=256,
               max_model_len=MAX_LEN)


GREEDY = {"temperature": 0.0, "max_tokens": 12}
M = "pensieve-demo"


def _extra(obj: object, name: str) -> object:
    return (getattr(obj, "model_extra", None) or {}).get(name)


def _check_against_offline(srv: Server, offline: LLM, cid: str) -> list[dict]:
    """Every turn's greedy answer equals the offline engine's from the same history."""
    conv = httpx.get(f"{srv.url}/v1/conversations/{cid}").json()
    ids = conv["token_ids"]
    for t in conv["turns"]:
        ctx, n = t["context_len"], t["output_len"]
        out = offline.generate([ids[:ctx]], SamplingParams(max_tokens=n, temperature=0.0))[0]
        assert out.output_token_ids == ids[ctx:ctx + n]
    return conv["turns"]


def _check_chat_against_stateless(srv: Server, offline: LLM, cid: str) -> list[dict]:
    """Every turn's context is exactly the chat template of the messages before it, and its
    greedy answer is what a stateless run of that rendering answers."""
    from pensieve.models.tokenizer import load_tokenizer
    from pensieve.server.chat import ChatRenderer

    renderer = ChatRenderer(load_tokenizer("demo"))
    conv = httpx.get(f"{srv.url}/v1/conversations/{cid}").json()
    msgs, turns = conv["messages"], conv["turns"]
    answers = [k for k, m in enumerate(msgs) if m["role"] == "assistant"]
    assert len(answers) == len(turns)
    for k, t in zip(answers, turns):
        ctx = renderer.render(msgs[:k], add_generation_prompt=True)
        assert t["context_len"] == len(ctx)
        out = offline.generate([ctx], SamplingParams(max_tokens=t["output_len"],
                                                     temperature=0.0))[0]
        assert renderer.decode(out.output_token_ids) == msgs[k]["content"]
    assert conv["token_ids"][:turns[-1]["context_len"]] == ctx
    return turns  # type: ignore[no-any-return]


def test_implicit_conversation_reuses_kv_streaming_and_not(server: Server, offline: LLM) -> None:
    client = server.client()
    msgs = [{"role": "user", "content": "Tell me about memory palaces."}]
    r1 = client.chat.completions.create(model="pensieve-demo", messages=msgs, **GREEDY)
    cid = _extra(r1, "conversation_id")
    assert isinstance(cid, str) and cid.startswith("conv-")
    assert _extra(r1, "pensieve")["cache"]["gpu_hit_tokens"] == 0
    hits_before = server.metric('pensieve_prompt_tokens_total{source="gpu_hit"}')
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "And how do I build one?"}]
    text, seen = "", set()
    for chunk in client.chat.completions.create(model="pensieve-demo", messages=msgs,
                                                stream=True, **GREEDY):
        seen.add(_extra(chunk, "conversation_id"))
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    # the re-sent history recognised: a new conversation over its KV (a history matched is a
    # cache hit, not an identity)
    (cid2,) = seen
    assert cid2 != cid
    assert server.metric('pensieve_prompt_tokens_total{source="gpu_hit"}') > hits_before
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "Thanks!"}]
    r3 = client.chat.completions.create(model="pensieve-demo", messages=msgs, **GREEDY)
    cid3 = _extra(r3, "conversation_id")
    assert cid3 not in (cid, cid2)
    assert _extra(r3, "pensieve")["cache"]["gpu_hit_tokens"] > 0
    assert len(_check_chat_against_stateless(server, offline, cid3)) == 3


def test_explicit_conversation_id_sends_only_new_messages(server: Server, offline: LLM) -> None:
    client = server.client()
    r1 = client.chat.completions.create(
        model="pensieve-demo", messages=[{"role": "user", "content": "Hello"}], **GREEDY)
    cid = _extra(r1, "conversation_id")
    for i, stream in enumerate([False, True, False]):
        body = {"conversation_id": cid, "keep_alive_s": 30.0, "retention_priority": 2.0}
        new = [{"role": "user", "content": f"Question {i}?"}]
        if stream:
            chunks = list(client.chat.completions.create(
                model="pensieve-demo", messages=new, stream=True, extra_body=body, **GREEDY))
            assert {_extra(c, "conversation_id") for c in chunks} == {cid}
        else:
            r = client.chat.completions.create(model="pensieve-demo", messages=new,
                                               extra_body=body, **GREEDY)
            assert _extra(r, "conversation_id") == cid
            assert _extra(r, "pensieve")["cache"]["gpu_hit_tokens"] > 0
    turns = _check_chat_against_stateless(server, offline, cid)
    assert len(turns) == 4
    conv = httpx.get(f"{server.url}/v1/conversations/{cid}").json()
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant"] * 4
    assert conv["retention_priority"] == conv["priority"] == 2.0
    assert conv["keep_alive_s"] == 30.0


def test_completions_endpoint_and_models(server: Server) -> None:
    client = server.client()
    models = client.models.list().data
    assert models[0].id == "pensieve-demo"
    assert "random weights" in _extra(models[0], "description")
    r = client.completions.create(model="pensieve-demo", prompt="Once upon a time",
                                  max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    r2 = client.completions.create(model="pensieve-demo", prompt=[1, 415, 2936], max_tokens=3,
                                   temperature=0)
    assert r2.usage.prompt_tokens == 3


def _post(srv: Server, path: str, **kw: object) -> httpx.Response:
    return httpx.post(srv.url + path, timeout=60, **kw)  # type: ignore[arg-type]


def _assert_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    return err


def test_bad_input_gets_clear_4xx(server: Server) -> None:
    path = "/v1/chat/completions"
    hdr = {"content-type": "application/json"}
    _assert_error(_post(server, path, content=b"{not json", headers=hdr), 400)
    _assert_error(_post(server, path, json={"messages": "hi"}), 400)
    _assert_error(_post(server, path, json={"messages": []}), 400)
    _assert_error(_post(server, path, json={"messages": [{"role": "wizard", "content": "x"}]}),
                  400)
    user = [{"role": "user", "content": "hi"}]
    for bad in ({"max_tokens": 0}, {"max_tokens": "many"}, {"max_tokens": MAX_LEN * 2},
                {"temperature": -1}, {"top_p": 0}, {"n": 17}, {"tools": [{"type": "function"}]}):
        _assert_error(_post(server, path, json={"messages": user, **bad}), 400)
    long = [{"role": "user", "content": "memory " * MAX_LEN}]
    err = _assert_error(_post(server, path, json={"messages": long}), 400)
    assert err["code"] == "context_length_exceeded"
    err = _assert_error(_post(server, path, json={"messages": user, "conversation_id": "conv-x"}),
                        404)
    assert err["code"] == "conversation_not_found"
    _assert_error(httpx.get(server.url + "/v1/conversations/conv-nope"), 404)
    _assert_error(_post(server, "/v1/completions", json={"prompt": []}), 400)
    _assert_error(_post(server, "/v1/completions", json={"prompt": [1, 10**9]}), 400)
    server.wait_idle()  # nothing was left running by the rejected requests


def test_second_turn_while_running_is_409(server: Server) -> None:
    r = _post(server, "/v1/chat/completions",
              json={"messages": [{"role": "user", "content": "start"}], "max_tokens": 2})
    cid = r.json()["conversation_id"]
    body = {"messages": [{"role": "user", "content": "long"}], "conversation_id": cid,
            "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as s:
        lines = s.iter_lines()
        next(lines)
        second = _post(server, "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "x"}],
                             "conversation_id": cid})
        err = _assert_error(second, 409)
        assert err["code"] == "conversation_busy"
        _assert_error(httpx.delete(f"{server.url}/v1/conversations/{cid}"), 409)
    server.wait_idle()


def test_client_disconnect_aborts_and_leaves_conversation_unchanged(server: Server) -> None:
    server.wait_idle()
    r = _post(server, "/v1/chat/completions",
              json={"messages": [{"role": "user", "content": "a story"}], "max_tokens": 4})
    cid = r.json()["conversation_id"]
    before = httpx.get(f"{server.url}/v1/conversations/{cid}").json()
    used = server.metric('pensieve_blocks_used{tier="gpu"}')
    body = {"messages": [{"role": "user", "content": "go on"}], "conversation_id": cid,
            "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as s:
        got = 0
        for line in s.iter_lines():
            got += line.startswith("data: ")
            if got >= 3:
                break  # leave mid-stream
    server.wait_idle()
    assert server.metric('pensieve_blocks_used{tier="gpu"}') == used  # blocks back
    after = httpx.get(f"{server.url}/v1/conversations/{cid}").json()
    assert after == before  # the aborted turn was not recorded
    # and the conversation still works
    r2 = _post(server, "/v1/chat/completions",
               json={"messages": [{"role": "user", "content": "again"}], "conversation_id": cid,
                     "max_tokens": 3})
    assert r2.status_code == 200 and r2.json()["conversation_id"] == cid


def test_delete_conversation_frees_kv_and_history(server: Server) -> None:
    server.wait_idle()
    used = server.metric('pensieve_blocks_used{tier="gpu"}')
    r = _post(server, "/v1/chat/completions",
              json={"messages": [{"role": "user", "content": "word " * 100}], "max_tokens": 4})
    cid = r.json()["conversation_id"]
    assert server.metric('pensieve_blocks_used{tier="gpu"}') > used
    d = httpx.delete(f"{server.url}/v1/conversations/{cid}")
    assert d.status_code == 200 and d.json()["deleted"] is True
    assert server.metric('pensieve_blocks_used{tier="gpu"}') == used
    _assert_error(httpx.get(f"{server.url}/v1/conversations/{cid}"), 404)


def test_chat_terminal_client(server: Server) -> None:
    from pensieve.chat_client import chat
    from pensieve.cli import build_parser

    args = build_parser().parse_args(["chat", "--url", server.url, "--max-tokens", "4",
                                      "--temperature", "0"])
    out = io.StringIO()
    assert chat(args, stdin=io.StringIO("hello\nmore please\n/id\n/quit\n"), out=out) == 0
    lines = out.getvalue().splitlines()
    cid = next(line for line in lines if line.startswith("> conv-") or line.startswith("conv-"))
    cid = cid.removeprefix("> ")
    conv = httpx.get(f"{server.url}/v1/conversations/{cid}").json()
    assert len(conv["turns"]) == 2  # the second message continued the same conversation


class _SSE:
    """A client whose ``stream`` answers 200 with the given SSE text."""

    def __init__(self, text: str) -> None:
        self.text = text

    def stream(self, method: str, url: str, json: Any = None) -> Any:
        import contextlib
        from types import SimpleNamespace

        return contextlib.nullcontext(SimpleNamespace(
            status_code=200, iter_text=lambda: iter([self.text])))


def test_chat_client_shows_an_error_event_and_keeps_the_conversation() -> None:
    """A turn that fails mid-stream (an engine error, the server shutting down) prints the
    error and leaves the chat on the conversation it had before the turn."""
    import argparse

    from pensieve.chat_client import _stream_turn

    args = argparse.Namespace(max_tokens=8, temperature=0.0)
    sse = ('data: {"conversation_id": "conv-new", "choices": [{"delta": {"content": "Hel"}}]}\n'
           '\ndata: {"error": {"message": "the server is shutting down", '
           '"code": "shutting_down"}}\n\ndata: [DONE]\n\n')
    out = io.StringIO()
    assert _stream_turn(_SSE(sse), args, [], "conv-old", out) == "conv-old"
    assert "Hel\n[error] the server is shutting down" in out.getvalue()
    ok = 'data: {"conversation_id": "conv-old", "choices": [{"delta": {"content": "Hi"}}]}\n\n'
    assert _stream_turn(_SSE(ok + "data: [DONE]\n\n"), args, [], None, io.StringIO()) == (
        "conv-old")


class _CtrlC(io.StringIO):
    """Terminal output whose first answer text is interrupted by Ctrl-C."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = True

    def write(self, s: str) -> int:
        if self.armed and s and not s.startswith((">", "chatting", "\n", "(")):
            self.armed = False
            raise KeyboardInterrupt
        return super().write(s)


def test_chat_client_ctrl_c_cancels_the_answer_and_401_is_explained(server: Server,
                                                                     keyed: Server) -> None:
    from pensieve.chat_client import chat, sse_lines
    from pensieve.cli import build_parser

    assert list(sse_lines(["data: a\u2028b\n", "\ndata: [DO", "NE]\n\n"])) == [
        "data: a\u2028b", "", "data: [DONE]", ""]
    args = build_parser().parse_args(["chat", "--url", server.url, "--max-tokens", "40",
                                      "--temperature", "0"])
    out = _CtrlC()
    assert chat(args, stdin=io.StringIO("first\nsecond\n/id\n/quit\n"), out=out) == 0
    text = out.getvalue()
    assert "[cancelled]" in text
    cid = text.split("> ")[-2].strip()  # /id printed the conversation of the second answer
    conv = httpx.get(f"{server.url}/v1/conversations/{cid}").json()
    assert [m["content"] for m in conv["messages"] if m["role"] == "user"] == ["second"]
    args = build_parser().parse_args(["chat", "--url", keyed.url, "--api-key", "wrong"])
    out2 = io.StringIO()
    assert chat(args, stdin=io.StringIO(""), out=out2) == 1
    assert "bad or missing API key" in out2.getvalue()


def test_auth_and_tenant_isolation(keyed: Server) -> None:
    srv = keyed
    assert httpx.get(srv.url + "/health").status_code == 200
    _assert_error(httpx.get(srv.url + "/v1/models"), 401)
    _assert_error(httpx.get(srv.url + "/metrics",
                            headers={"Authorization": "Bearer wrong"}), 401)
    with pytest.raises(openai.AuthenticationError):
        srv.client("wrong").models.list()
    a, b = srv.client("key-a"), srv.client("key-b")
    msgs = [{"role": "user", "content": "secret plans " * 20}]
    ra = a.chat.completions.create(model="pensieve-demo", messages=msgs, **GREEDY)
    cid = _extra(ra, "conversation_id")
    hdr_b = {"Authorization": "Bearer key-b"}
    _assert_error(httpx.get(f"{srv.url}/v1/conversations/{cid}", headers=hdr_b), 404)
    _assert_error(httpx.delete(f"{srv.url}/v1/conversations/{cid}", headers=hdr_b), 404)
    with pytest.raises(openai.NotFoundError):
        b.chat.completions.create(model=M, messages=[{"role": "user", "content": "x"}],
                                  extra_body={"conversation_id": cid}, **GREEDY)
    # B re-sends A's exact history: a new conversation of B's, with no hit on A's KV
    follow = msgs + [{"role": "assistant", "content": ra.choices[0].message.content},
                     {"role": "user", "content": "go on"}]
    rb = b.chat.completions.create(model="pensieve-demo", messages=follow, **GREEDY)
    assert _extra(rb, "conversation_id") != cid
    assert _extra(rb, "pensieve")["cache"]["gpu_hit_tokens"] == 0
    assert _extra(rb, "pensieve")["cache"]["shared_hit_tokens"] == 0  # salted per tenant
    # while A doing the same finds its own history's KV (a new conversation over it)
    ra2 = a.chat.completions.create(model="pensieve-demo", messages=follow, **GREEDY)
    assert _extra(ra2, "conversation_id") not in (cid, _extra(rb, "conversation_id"))
    assert _extra(ra2, "pensieve")["cache"]["gpu_hit_tokens"] > 0


def test_conversation_survives_sigkill(tmp_path: Path, cache_dir: Path, offline: LLM) -> None:
    store = tmp_path / "persist.db"
    srv = Server(store, cache_dir)
    client = srv.client()
    r = client.chat.completions.create(model=M, messages=[{"role": "user", "content": "Hi"}],
                                       **GREEDY)
    cid = _extra(r, "conversation_id")
    client.chat.completions.create(model=M, messages=[{"role": "user", "content": "Next"}],
                                   extra_body={"conversation_id": cid}, **GREEDY)
    done = httpx.get(f"{srv.url}/v1/conversations/{cid}").json()
    # load in flight: other conversations streaming long answers when the server dies
    streams = [httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=60,
                            json={"messages": [{"role": "user", "content": f"load {i}"}],
                                  "max_tokens": 400, "ignore_eos": True, "stream": True})
               for i in range(3)]
    opened = [s.__enter__() for s in streams]
    for s in opened:
        next(s.iter_lines())
    srv.stop(signal.SIGKILL)
    for s in streams:
        try:
            s.__exit__(None, None, None)
        except httpx.HTTPError:
            pass
    srv2 = Server(store, cache_dir)
    try:
        again = httpx.get(f"{srv2.url}/v1/conversations/{cid}").json()
        assert again["turns"] == done["turns"] and again["token_ids"] == done["token_ids"]
        c2 = srv2.client()
        r3 = c2.chat.completions.create(model=M, messages=[{"role": "user", "content": "Last"}],
                                        extra_body={"conversation_id": cid}, **GREEDY)
        assert _extra(r3, "pensieve")["cache"]["recomputed_tokens"] > 0  # KV was gone
        turns = _check_chat_against_stateless(srv2, offline, cid)  # as without the restart
        assert len(turns) == 3
    finally:
        srv2.stop()


def _sse(srv: Server, body: dict) -> list[dict]:
    """The data objects of a streamed completion (without the closing [DONE])."""
    import json

    out = []
    with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as s:
        assert s.status_code == 200, s.read()
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def test_completions_create_conversation_then_continue_with_new_tokens(
        server: Server, offline: LLM) -> None:
    server.wait_idle()
    base = {"temperature": 0, "ignore_eos": True}
    # without the flag a completion stays outside any conversation (as before)
    plain = _post(server, "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, **base})
    assert plain.status_code == 200 and plain.json()["conversation_id"] is None
    first = [11, 12, 13, 14, 15, 16, 17]
    r1 = _post(server, "/v1/completions",
               json={"prompt": first, "max_tokens": 5, "create_conversation": True, **base})
    assert r1.status_code == 200, r1.text
    cid = r1.json()["conversation_id"]
    assert isinstance(cid, str) and cid.startswith("conv-") and len(cid) > 20
    assert r1.headers["x-conversation-id"] == cid
    assert r1.json()["usage"] == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
                                  "prompt_tokens_details": {"cached_tokens": 0}}
    assert r1.json()["pensieve"]["cache"]["gpu_hit_tokens"] == 0
    # a later turn sends only its new tokens, streamed: every chunk names the conversation, the
    # final one carries the turn's cache stats, the usage chunk the whole context
    chunks = _sse(server, {"prompt": [21, 22, 23], "max_tokens": 4, "conversation_id": cid,
                           "stream_options": {"include_usage": True}, **base})
    assert {c["conversation_id"] for c in chunks} == {cid}
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0]["choices"][0]["finish_reason"] == "length"
    cache = final[0]["pensieve"]["cache"]
    # the history's KV is reused, all but the last answer token (never fed back, so no KV)
    assert cache["gpu_hit_tokens"] == 11 and cache["new_prompt_tokens"] == 3 + 1
    assert chunks[-1]["object"] == "text_completion"
    assert chunks[-1]["usage"] == {"prompt_tokens": 15, "completion_tokens": 4,
                                   "total_tokens": 19, "prompt_tokens_details":
                                   {"cached_tokens": 11}}
    # a streamed first turn creates a conversation too; the two are distinct
    chunks2 = _sse(server, {"prompt": first, "max_tokens": 3, "create_conversation": True,
                            **base})
    cid2 = chunks2[0]["conversation_id"]
    assert cid2 != cid and {c["conversation_id"] for c in chunks2} == {cid2}
    turns = _check_against_offline(server, offline, cid)  # greedy answers match offline
    assert turns == [{"context_len": 7, "output_len": 5}, {"context_len": 15, "output_len": 4}]
    assert len(_check_against_offline(server, offline, cid2)) == 1
    # the conversation belongs to its tenant: an unknown id is refused as before
    err = _assert_error(_post(server, "/v1/completions",
                              json={"prompt": [1], "conversation_id": cid + "x"}), 404)
    assert err["code"] == "conversation_not_found"


def test_metrics_step_accounting(server: Server) -> None:
    """/metrics exports the engine's own step accounting: steps, computed tokens by kind and
    executor seconds grow by what a request computed."""
    server.wait_idle()
    steps = server.metric('pensieve_steps_total{kind="prefill"}')
    prefill = server.metric('pensieve_computed_tokens_total{kind="prefill"}')
    decode = server.metric('pensieve_computed_tokens_total{kind="decode"}')
    secs = server.metric('pensieve_step_execute_seconds_total{kind="prefill"}')
    issue = server.metric('pensieve_step_host_issue_seconds_total{kind="decode"}')
    spans = server.metric("pensieve_decode_split_span_steps_total")
    r = _post(server, "/v1/chat/completions",
              json={"messages": [{"role": "user", "content": "count the steps"}],
                    "max_tokens": 5, "ignore_eos": True})
    usage = r.json()["usage"]
    server.wait_idle()
    assert server.metric('pensieve_steps_total{kind="prefill"}') > steps
    assert server.metric('pensieve_computed_tokens_total{kind="prefill"}') - prefill == \
        usage["prompt_tokens"]
    # the first output token is sampled by the prefill step; each later one is a decode
    assert server.metric('pensieve_computed_tokens_total{kind="decode"}') - decode == 4
    # one request's decode steps are never ragged: none split KV by span (PENSIEVE_DECODE_SPAN
    # is auto)
    assert server.metric("pensieve_decode_split_span_steps_total") == spans
    # the CPU has no CUDA graphs: every step ran eagerly
    for kind in ("prefill", "decode"):
        assert server.metric(f'pensieve_graph_steps_total{{kind="{kind}"}}') == 0
    assert server.metric('pensieve_step_execute_seconds_total{kind="prefill"}') > secs
    assert server.metric('pensieve_scheduler_seconds_total{phase="schedule"}') > 0
    # the runner's host time, next to the step time: prepare <= issue <= execute
    assert server.metric('pensieve_step_host_issue_seconds_total{kind="decode"}') > issue
    for kind in ("prefill", "decode"):
        prep = server.metric(f'pensieve_step_host_prepare_seconds_total{{kind="{kind}"}}')
        iss = server.metric(f'pensieve_step_host_issue_seconds_total{{kind="{kind}"}}')
        exe = server.metric(f'pensieve_step_execute_seconds_total{{kind="{kind}"}}')
        assert 0 < prep <= iss <= exe


def test_out_of_range_sampling_fields_get_400_and_others_keep_streaming(server: Server) -> None:
    """A sampling field the sampler cannot take (a top_k past int64, a negative seed) is a 400
    naming the field, before it reaches the engine: a stream in flight is not disturbed."""
    server.wait_idle()
    body = {"messages": [{"role": "user", "content": "keep going"}], "max_tokens": 24,
            "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as s:
        lines = s.iter_lines()
        next(lines)
        for bad, field in (({"top_k": 1180591620717411303424}, "top_k"),
                           ({"seed": -5}, "seed"), ({"seed": 2**64}, "seed")):
            r = _post(server, "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                            **bad})
            err = _assert_error(r, 400)
            assert err["param"] == field, err
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert any('"finish_reason": "length"' in line or '"finish_reason":"length"' in line
               for line in rest)
    server.wait_idle()


def test_lone_surrogate_is_a_400(server: Server) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   content=b'{"messages": [{"role": "user", "content": "\\ud800"}], '
                           b'"max_tokens": 2}',
                   headers={"content-type": "application/json"})
    err = _assert_error(r, 400)
    assert "Unicode" in err["message"] and err["param"] == "messages.0.content"


def test_shared_system_prompt_is_cached_from_the_second_conversation(keyed: Server) -> None:
    """Issue 45's repro: six conversations of one tenant open with the same ~700-token system
    prompt and a question each; from the second on, the prompt's full chunks are another
    conversation's KV (``cached_tokens`` > 0, counted as ``shared_hit``). Another tenant, or a
    request with its own ``cache_salt``, shares nothing."""
    srv = keyed  # shared with other tests: its counters are read as differences
    shared_before = srv.metric('pensieve_prompt_tokens_total{source="shared_hit"}', "ops")
    a, b = srv.client("key-a"), srv.client("key-b")
    system = {"role": "system", "content": "You are a careful librarian. " * 100}
    cached = []
    for k in range(6):
        r = a.chat.completions.create(
            model=M, messages=[system, {"role": "user", "content": f"Question {k}: which?"}],
            **GREEDY)
        assert r.usage.prompt_tokens > 600
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        assert _extra(r, "pensieve")["cache"]["shared_hit_tokens"] == cached[-1]
    assert cached[0] == 0 and all(c >= 600 for c in cached[1:]), cached
    shared = srv.metric('pensieve_prompt_tokens_total{source="shared_hit"}', "ops")
    assert shared - shared_before == sum(cached[1:])
    assert srv.metric("pensieve_prefix_sharing_ratio", "ops") > 1.0
    rb = b.chat.completions.create(
        model=M, messages=[system, {"role": "user", "content": "Question 0: which?"}],
        **GREEDY)
    assert rb.usage.prompt_tokens_details.cached_tokens == 0  # another tenant
    salted = a.chat.completions.create(
        model=M, messages=[system, {"role": "user", "content": "Question 9: which?"}],
        extra_body={"cache_salt": "mine"}, **GREEDY)
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
