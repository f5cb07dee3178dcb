"""A replica that stores a turn and dies before its answer reaches the ingress, and the
ingress's retry of the same request on another replica, deterministically and without Ray:
two server apps (two replicas) in this process on one SQLite store, each request sent with its
key as the ingress sends it (:func:`pensieve.replicas.asgi.with_request_key`).

Without the key the retry of a re-sent history found no conversation (the stored one already
held the turn) and started a new one with one turn: the conversation the client went on with
lacked its earlier turns (the replica-kill defect, a run in about five). With it the retry
redoes the stored turn under the same id, and the store holds exactly the turns the client
received. Also: the ingress's read-ahead retries a replica that died between the start of an
answer and its body.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

ray = pytest.importorskip("ray", reason="the replicas extra is not installed")

from test_replicas import serve_args  # noqa: E402

from pensieve.replicas.asgi import REQUEST_KEY_HEADER, call_asgi, with_request_key  # noqa: E402
from pensieve.replicas.serve import read_answer  # noqa: E402
from pensieve.server.main import build_server  # noqa: E402
from pensieve.server.store_open import open_store  # noqa: E402


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two replicas' apps on one store, and the store (a third handle, to read it)."""
    path = str(tmp_path_factory.mktemp("retry") / "conv.db")
    built = [build_server(serve_args(path)) for _ in range(2)]
    store = open_store(path)
    yield [with_request_key(app) for app, _ in built], store
    store.close()
    for _, close in built:
        close()


def post(app, path: str, body: dict, key: str | None) -> dict:
    """The app's JSON answer to a POST (with the request key ``key``, as from the ingress)."""
    headers = [(b"content-type", b"application/json")]
    if key is not None:
        headers.append((REQUEST_KEY_HEADER, key.encode()))

    async def go():
        return [x async for x in call_asgi(app, "POST", path, b"", headers,
                                           json.dumps(body).encode())]

    items = asyncio.run(go())
    assert items[0][1] == 200, items
    return json.loads(b"".join(items[1:]))


def chat(app, msgs, key, **extra) -> dict:
    return post(app, "/v1/chat/completions",
                {"messages": msgs, "max_tokens": 6, "temperature": 0, **extra}, key)


def answer(r: dict) -> dict:
    return {"role": "assistant", "content": r["choices"][0]["message"]["content"]}


def test_retry_of_a_stored_history_turn_redoes_it(replicas):
    """History re-sent: turn 1 (a new conversation over turn 0's history, as every re-sent
    history is) is stored by replica A, whose answer is lost; the retry on B (same key)
    answers under that conversation's id and the store holds turns 0-2 as the client
    received them. Without a key the same request is another new conversation (a client
    re-sending a history whose last turn it never saw: its own retry)."""
    (a, b), store = replicas
    m0 = [{"role": "user", "content": "retry me: the history way"}]
    r0 = chat(a, m0, uuid.uuid4().hex)
    cid = r0["conversation_id"]
    m1 = m0 + [answer(r0), {"role": "user", "content": "second"}]
    key = uuid.uuid4().hex
    cid1 = chat(a, m1, key)["conversation_id"]  # stored, then A dies: the answer is lost
    assert cid1 != cid and len(store.get(cid1).turns) == 2 and len(store.get(cid).turns) == 1
    r1 = chat(b, m1, key)  # the ingress's retry
    assert r1["conversation_id"] == cid1
    conv = store.get(cid1)
    assert conv.messages == m1 + [answer(r1)] and len(conv.turns) == 2
    assert conv.version == 2  # A's turn 1, B's redo of it
    m2 = m1 + [answer(r1), {"role": "user", "content": "third"}]
    r2 = chat(b, m2, uuid.uuid4().hex)
    cid2 = r2["conversation_id"]
    assert cid2 not in (cid, cid1)
    conv = store.get(cid2)
    assert conv.messages == m2 + [answer(r2)] and len(conv.turns) == 3
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    other = chat(b, m2, None)  # no key: not a retry, a new conversation
    assert other["conversation_id"] not in (cid, cid1, cid2)
    assert len(store.get(cid2).turns) == 3


def test_retry_of_a_first_turn_and_of_a_named_conversation(replicas):
    """A new conversation's first turn stored by A, retried on B: one conversation (its id),
    not two. A turn of a conversation named by id, retried: the user message once, not
    twice."""
    (a, b), store = replicas
    before = store.count()
    m0 = [{"role": "user", "content": "retry me: first turn"}]
    key = uuid.uuid4().hex
    lost = chat(a, m0, key)
    r0 = chat(b, m0, key)
    cid = r0["conversation_id"]
    assert cid == lost["conversation_id"] and store.count() == before + 1
    assert store.get(cid).messages == m0 + [answer(r0)]
    new = [{"role": "user", "content": "by id"}]
    key = uuid.uuid4().hex
    chat(a, new, key, conversation_id=cid)
    r1 = chat(b, new, key, conversation_id=cid)
    conv = store.get(cid)
    assert conv.messages == m0 + [answer(r0)] + new + [answer(r1)]
    assert len(conv.turns) == 2


def test_retry_of_a_completion_turn_and_a_conversation_back_on_its_replica(replicas):
    """Completions of a conversation by id: turn 1 stored by A and retried on B is in the
    history once; turn 2 on B, then turn 3 back on A (whose engine last saw turn 1)
    continues the stored history, not A's."""
    (a, b), store = replicas

    def complete(app, prompt, key, **extra):
        return post(app, "/v1/completions", {"prompt": prompt, "max_tokens": 5,
                                             "temperature": 0, **extra}, key)

    r0 = complete(a, [5, 6, 7, 8], uuid.uuid4().hex, create_conversation=True)
    cid = r0["conversation_id"]
    key = uuid.uuid4().hex
    complete(a, [9, 10], key, conversation_id=cid)
    r1 = complete(b, [9, 10], key, conversation_id=cid)
    conv = store.get(cid)
    assert len(conv.turns) == 2 and len(conv.messages) == 2
    assert conv.turns[1]["context_len"] == conv.turns[0]["context_len"] + 5 + 2
    assert r1["usage"]["prompt_tokens"] == conv.turns[1]["context_len"]
    complete(b, [11], uuid.uuid4().hex, conversation_id=cid)  # turn 2 on B only
    conv = store.get(cid)
    r3 = complete(a, [12], uuid.uuid4().hex, conversation_id=cid)
    conv3 = store.get(cid)
    assert len(conv3.turns) == 4
    assert conv3.token_ids[:len(conv.token_ids) + 1] == conv.token_ids + [12]
    assert r3["usage"]["prompt_tokens"] == len(conv.token_ids) + 1


class _Dies:
    """A replica's answer stream that yields ``items`` then dies (the actor killed)."""

    def __init__(self, items, dies: bool):
        self.items, self.dies = list(items), dies

    async def __anext__(self):
        if self.items:
            return self.items.pop(0)
        if self.dies:
            raise ray.exceptions.RayActorError()
        raise StopAsyncIteration

    def __aiter__(self):
        return self


def test_read_answer_retries_until_the_answer_is_read():
    """A replica that dies after the start of a JSON answer but before its body is retried
    (the next one answers whole); an event stream is handed on at its first chunk."""
    json_start = ("start", 200, [(b"content-type", b"application/json")])
    calls = iter([_Dies([json_start], True), _Dies([json_start, b"{}"], False)])
    gen, head, done, attempts = asyncio.run(read_answer(lambda: next(calls), backoff_s=0))
    assert (head, done, attempts) == ([json_start, b"{}"], True, 2)
    sse_start = ("start", 200, [(b"content-type", b"text/event-stream; charset=utf-8")])
    gen, head, done, attempts = asyncio.run(read_answer(
        lambda: _Dies([sse_start, b"data: 1", b"data: 2"], False), backoff_s=0))
    assert (head, done, attempts) == ([sse_start, b"data: 1"], False, 1)
    with pytest.raises(RuntimeError):
        asyncio.run(read_answer(lambda: _Dies([], True), retries=2, backoff_s=0))
