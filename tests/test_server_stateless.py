"""Issue 60, fault 1: a request without a conversation id that re-sends a stored history is a
new conversation over that history's KV (``server/engine_ids.py``), never the matched one:
two users of one key who sent the same messages never share a conversation, never see each
other's questions and never wait for each other (no 409); a stateless client still computes
only its new tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from server_scripted import build_tokenizer
from test_server_audit import CHAT, MSGS, _enc, _serve


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tokenizer("chatml")


@pytest.fixture
def served(tok: Any, tmp_path: Path) -> Iterator[tuple[TestClient, Any, Any]]:
    yield from _serve(tok, tmp_path)


class _Slow:
    """The scripted executor, ``step_s`` per step: concurrent turns share their steps."""

    def __init__(self, inner: Any, step_s: float = 0.02) -> None:
        self.inner, self.step_s = inner, step_s

    @property
    def tiers(self) -> Any:
        return self.inner.tiers

    def execute(self, sched: Any) -> Any:
        import time

        time.sleep(self.step_s)
        return self.inner.execute(sched)

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def shutdown(self) -> None:
        pass


def test_two_users_of_one_key_never_share_a_conversation(tok: Any, tmp_path: Path) -> None:
    """Issue 60's repro: two users of one key each send "Hi!" and get the same greedy
    answer; four requests then re-send that history with their own questions at once,
    without a conversation id. Each is a conversation of its own (none got a 409; no
    question shows in another's conversation), and the history's KV is reused."""
    from concurrent.futures import ThreadPoolExecutor

    for http, ex, _ in _serve(tok, tmp_path, wrap=_Slow):
        ex.script = _enc(tok, " Hello there!") + [tok.eos_token_id]
        hi = [{"role": "user", "content": "Hi!"}]
        first = [http.post(CHAT, json={"messages": hi, "max_tokens": 8, "temperature": 0})
                 for _ in range(2)]
        assert [r.status_code for r in first] == [200, 200]
        answer = first[0].json()["choices"][0]["message"]["content"]
        assert answer == first[1].json()["choices"][0]["message"]["content"]
        users = [r.json()["conversation_id"] for r in first]
        history = hi + [{"role": "assistant", "content": answer}]
        questions = [f"My secret number is {k}. What is it?" for k in range(4)]

        def ask(q: str, http: TestClient = http, history: list[Any] = history) -> Any:
            return http.post(CHAT, json={"messages": history + [{"role": "user", "content": q}],
                                         "max_tokens": 8, "temperature": 0})

        with ThreadPoolExecutor(4) as pool:
            rs = list(pool.map(ask, questions))
        assert [r.status_code for r in rs] == [200] * 4, [r.text for r in rs]
        ids = [r.json()["conversation_id"] for r in rs]
        assert len(set(ids)) == 4 and not set(ids) & set(users), ids
        for cid in users:  # the first turns' conversations are as their users left them
            assert http.get(f"/v1/conversations/{cid}").json()["messages"] == history
        for cid, q in zip(ids, questions, strict=True):
            msgs = http.get(f"/v1/conversations/{cid}").json()["messages"]
            assert msgs[:3] == history + [{"role": "user", "content": q}], msgs
            assert len(msgs) == 4
        cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in rs]
        print(f"\ncached tokens of the four: {cached}")
        assert max(cached) > 0  # one of them took the history's KV over


def test_a_stateless_client_computes_only_its_new_tokens(tok: Any, served: Any) -> None:
    """A client that re-sends its whole history each turn gets a new conversation each turn,
    over the previous turn's KV: only the new tokens are computed."""
    http, ex, _ = served
    ex.script = _enc(tok, " Sure thing!") + [tok.eos_token_id]
    msgs: list[dict[str, Any]] = []
    seen: list[str] = []
    previous = 0
    for k in range(3):
        msgs.append({"role": "user", "content": f"Question {k}: what else?"})
        r = http.post(CHAT, json={"messages": msgs, "max_tokens": 8}).json()
        seen.append(r["conversation_id"])
        context = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                          return_dict=False)
        if k:
            # everything up to the previous answer came from the cache
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= previous, r
            assert ex.computed[-1] == len(context) - r["usage"]["prompt_tokens_details"][
                "cached_tokens"]
        previous = len(context)
        msgs.append(r["choices"][0]["message"])
        msgs[-1] = {"role": "assistant", "content": msgs[-1]["content"]}
    assert len(set(seen)) == 3
    assert http.get(f"/v1/conversations/{seen[0]}").json()["messages"] == msgs[:2]
    assert http.get(f"/v1/conversations/{seen[-1]}").json()["messages"] == msgs


def test_the_matched_conversation_continues_by_its_id(tok: Any, served: Any) -> None:
    """After a stateless request took its KV over, the matched conversation continued by its
    id still sees exactly its own history."""
    http, ex, _ = served
    ex.script = _enc(tok, " ok") + [tok.eos_token_id]
    r = http.post(CHAT, json={"messages": MSGS, "max_tokens": 4}).json()
    cid = r["conversation_id"]
    history = MSGS + [{"role": "assistant", "content": " ok"}]
    other = http.post(CHAT, json={"messages": history + [{"role": "user", "content": "B?"}],
                                  "max_tokens": 4}).json()
    assert other["conversation_id"] != cid
    mine = [{"role": "user", "content": "A?"}]
    r2 = http.post(CHAT, json={"messages": mine, "max_tokens": 4, "conversation_id": cid})
    assert r2.status_code == 200, r2.text
    assert ex.seen[-1] == tok.apply_chat_template(history + mine, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)
    assert http.get(f"/v1/conversations/{cid}").json()["messages"] == \
        history + mine + [{"role": "assistant", "content": " ok"}]


def test_engine_ids_take_over_give_back_and_bound() -> None:
    from pensieve.server.engine_ids import EngineIds

    ids = EngineIds(max_entries=4)
    assert ids.of("a") == "a"
    assert ids.take_over("a", "b") == "a"  # b holds a's engine conversation
    fresh = ids.of("a")
    assert fresh not in ("a", "b") and ids.of("b") == "a"
    assert ids.take_over("b", "c") == "a"  # and so on down a stateless client's turns
    ids.settle("c")
    assert ids.give_back("b") is True  # b's own turn failed: a gets nothing back (b had it)
    assert ids.of("a") == fresh and ids.of("c") == "a"
    assert ids.give_back("c") is False  # settled: the take-over stands
    assert ids.take_over("a", "d") == fresh
    assert ids.give_back("d") is True and ids.of("a") == fresh and ids.of("d") == "d"
    for k in range(10):
        ids.take_over(f"x{k}", f"y{k}")
    assert len(ids._of) <= 4 and len(ids._taken) <= 4
