"""Conversation ids that clients choose (vLLM's multi-turn benchmark with
``--send-conversation-id``): a first turn naming an unknown id starts that conversation,
later turns with the same name continue it with its KV (a cache hit), by the body's
``conversation_id``, ``X-Conversation-Id`` or ``X-Session-ID``; two API keys using one name
hold two conversations; headers that disagree are a 400; an unknown server id stays a 404."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_util import Server, run_cache

KEYS = ("--api-key", "key-a", "--api-key", "key-b")
GREEDY = {"temperature": 0, "max_tokens": 8, "model": "pensieve-demo"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("store") / "store.db", run_cache(), *KEYS,
               "--metrics-public")
    yield s
    s.stop()


def _chat(client: openai.OpenAI, text: str, **headers: str):
    return client.chat.completions.create(messages=[{"role": "user", "content": text}],
                                          extra_headers=headers or None, **GREEDY)


def _extra(r, key: str):
    return (r.model_extra or {})[key]


@pytest.mark.parametrize("header", ["X-Session-ID", "X-Conversation-Id"])
def test_named_first_turn_then_continue_with_kv(server, header):
    client = server.client("key-a")
    name = f"bench-{header}-1"
    r1 = _chat(client, "Hello there", **{header: name})
    cid = _extra(r1, "conversation_id")
    r2 = _chat(client, "And again", **{header: name})
    assert _extra(r2, "conversation_id") == cid
    assert _extra(r2, "pensieve")["cache"]["gpu_hit_tokens"] >= r1.usage.prompt_tokens - 1
    conv = httpx.get(f"{server.url}/v1/conversations/{name}",
                     headers={"Authorization": "Bearer key-a"}).json()
    assert conv["id"] == cid and [m["role"] for m in conv["messages"]] == [
        "user", "assistant", "user", "assistant"]
    # the body's field reaches the same conversation
    r3 = client.chat.completions.create(messages=[{"role": "user", "content": "Third"}],
                                        extra_body={"conversation_id": name}, **GREEDY)
    assert _extra(r3, "conversation_id") == cid


def test_names_are_scoped_to_the_key(server):
    a, b = server.client("key-a"), server.client("key-b")
    ra = _chat(a, "Hi from a", **{"X-Session-ID": "shared-name"})
    rb = _chat(b, "Hi from b", **{"X-Session-ID": "shared-name"})
    assert _extra(ra, "conversation_id") != _extra(rb, "conversation_id")
    r = httpx.get(f"{server.url}/v1/conversations/{_extra(ra, 'conversation_id')}",
                  headers={"Authorization": "Bearer key-b"})
    assert r.status_code == 404
    conv = httpx.get(f"{server.url}/v1/conversations/shared-name",
                     headers={"Authorization": "Bearer key-b"}).json()
    assert conv["messages"][0]["content"] == "Hi from b"


def test_disagreeing_ids_and_unknown_server_ids(server):
    client = server.client("key-a")
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, "x", **{"X-Session-ID": "one", "X-Conversation-Id": "two"})
    assert e.value.body["code"] == "conversation_id_mismatch"
    with pytest.raises(openai.NotFoundError):
        _chat(client, "x", **{"X-Session-ID": "conv-doesnotexist"})
    # completions: a named first turn starts a conversation too
    r1 = client.completions.create(prompt="One two", extra_headers={"X-Session-ID": "comp-1"},
                                   **GREEDY)
    r2 = client.completions.create(prompt=" three", extra_headers={"X-Session-ID": "comp-1"},
                                   **GREEDY)
    assert _extra(r1, "conversation_id") == _extra(r2, "conversation_id") is not None
    assert r2.usage.prompt_tokens > r1.usage.prompt_tokens
