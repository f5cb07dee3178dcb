"""A request the engine fails (failure containment: its execution raised, the others in its
step went on) is an error for that request only: an OpenAI-shaped 500, or an error event in
its stream, and its turn is not stored; the conversation stays as it was before the turn and
a retry continues it from its cached KV. The other requests, streaming at the same time,
finish normally."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
from server_scripted import ScriptedExecutor, build_tokenizer, scripted_app

from pensieve.core.outputs import RunnerOutput, ScheduledRequest, SchedulerOutput
from pensieve.engine.executor import TierSizes

POISON = "\u00a7"
"""A user message holding this character makes the executor fail its request (its byte
0xA7 is a token of its own that no other message here holds; special-token text in a
message would be tokenized as plain text)."""


class FailPoisoned:
    """Raises for a step holding a request whose context has the poison token, once that
    request has ``fail_at`` output tokens (0: its prefill); slow enough (``step_s``) that
    concurrent requests share its steps."""

    def __init__(self, inner: ScriptedExecutor, poison: int, step_s: float = 0.005) -> None:
        self.inner, self.poison, self.step_s = inner, poison, step_s
        self.fail_at: dict[str, int] = {}
        self.poisoned: set[str] = set()
        self.raised_with: list[int] = []
        """The number of requests in each step that raised."""

    @property
    def tiers(self) -> TierSizes:
        return self.inner.tiers

    def _fails(self, s: ScheduledRequest) -> bool:
        if any(self.poison in r.token_ids for r in s.ranges):
            self.poisoned.add(s.request_id)
        limit = self.fail_at.get("next", 0)
        return s.request_id in self.poisoned and s.num_output_tokens >= limit

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        time.sleep(self.step_s)
        if any([self._fails(s) for s in sched.requests]):
            self.raised_with.append(len(sched.requests))
            raise RuntimeError("sampler failed")
        return self.inner.execute(sched)

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def shutdown(self) -> None:
        pass


def _sse(text: str) -> list[dict[str, Any]]:
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_a_failed_request_is_its_own_error_and_its_turn_is_not_stored(tmp_path: Path) -> None:
    tok = build_tokenizer("chatml")
    poison = tok.convert_tokens_to_ids(POISON)  # the byte-level token of 0xA7
    holder: dict[str, FailPoisoned] = {}

    def wrap(ex: ScriptedExecutor) -> FailPoisoned:
        holder["x"] = FailPoisoned(ex, poison)
        return holder["x"]

    app, ex = scripted_app(tok, tmp_path / "conv.db", wrap=wrap)
    faulty = holder["x"]
    state = app.state.pensieve
    word = tok.encode(" Okay.", add_special_tokens=False)
    ex.script, ex.filler = [], word[0]
    answer = tok.decode([word[0]] * 24)

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            first = [{"role": "user", "content": "Tell me about memory palaces."}]
            r = await c.post("/v1/chat/completions", json={
                "messages": first, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            cid = r.json()["conversation_id"]
            before = (await c.get(f"/v1/conversations/{cid}")).json()
            history = await state.engine.call(lambda e: e.conversation_history(cid))
            assert len(history) == before["turns"][0]["context_len"] + 4

            def good(k: int) -> Any:
                return c.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": f"What else? {k}"}],
                    "max_tokens": 24, "temperature": 0, "stream": k % 2 == 0})

            bad_turn = {"messages": [{"role": "user", "content": f"Why? {POISON}"}],
                        "conversation_id": cid, "max_tokens": 24, "temperature": 0,
                        "stream": True}
            bad_new = {"messages": [{"role": "user", "content": f"Hi {POISON}"}],
                       "max_tokens": 24, "temperature": 0}
            faulty.fail_at["next"] = 3  # in decode, after a few streamed tokens
            rs = await asyncio.gather(*[good(k) for k in range(4)],
                                      c.post("/v1/chat/completions", json=bad_turn))
            # the others streamed (or answered) in full, alongside the failure
            for k, res in enumerate(rs[:4]):
                assert res.status_code == 200, res.text
                if k % 2 == 0:
                    chunks = _sse(res.text)
                    text = "".join(ch["choices"][0]["delta"].get("content") or ""
                                   for ch in chunks if ch.get("choices"))
                    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
                else:
                    text = res.json()["choices"][0]["message"]["content"]
                assert text == answer
            assert max(faulty.raised_with) > 1  # it failed in steps shared with the others
            # the failing stream: some text, then an OpenAI-shaped error event, no finish
            assert rs[4].status_code == 200
            events = _sse(rs[4].text)
            err = events[-1]["error"]
            assert err["type"] == "server_error" and err["code"] == "engine_error"
            assert "sampler failed" in err["message"]
            assert not any(ch["choices"][0]["finish_reason"] for ch in events[:-1])
            assert "".join(ch["choices"][0]["delta"].get("content") or ""
                           for ch in events[:-1])  # tokens came before the failure

            # a new conversation failing in its prefill: a 500, and nothing kept
            faulty.fail_at["next"] = 0
            n_stored = state.store.count()
            r = await c.post("/v1/chat/completions", json=bad_new)
            assert r.status_code == 500
            assert r.json()["error"]["code"] == "engine_error"
            assert state.store.count() == n_stored
            engine_convs = await state.engine.call(lambda e: set(e.cache.conversations))
            assert len(engine_convs) == n_stored

            # the failed turn left the conversation as it was, stored and in the engine
            assert (await c.get(f"/v1/conversations/{cid}")).json() == before
            assert await state.engine.call(lambda e: e.conversation_history(cid)) == history
            # ... and a retry continues it from its KV
            retry = {**bad_turn, "stream": False,
                     "messages": [{"role": "user", "content": "Why?"}]}
            r = await c.post("/v1/chat/completions", json=retry)
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["conversation_id"] == cid
            assert out["pensieve"]["cache"]["gpu_hit_tokens"] > 0
            expect = tok.apply_chat_template(
                first + [{"role": "assistant", "content": before["messages"][1]["content"]},
                         {"role": "user", "content": "Why?"}],
                add_generation_prompt=True, tokenize=False)
            assert ex.seen[-1] == tok.encode(expect, add_special_tokens=False)
            after = (await c.get(f"/v1/conversations/{cid}")).json()
            assert len(after["turns"]) == 2

    try:
        asyncio.run(run())
        st = state.engine.engine.cache_stats()
        assert st["failed_requests"] == 2
    finally:
        state.engine.shutdown()


def test_update_for_a_closed_event_loop_is_dropped() -> None:
    """At shutdown the server's event loop can close while the engine thread still has tokens
    for a stream: the update is dropped with the stream, and the engine thread keeps running
    (it used to die with 'Event loop is closed')."""
    import asyncio

    from server_scripted import scripted_engine

    from pensieve.server.async_engine import AsyncEngine
    from pensieve.server.engine_loop import Update

    eng, _ = scripted_engine(64, (1,))
    aeng = AsyncEngine(eng)  # type: ignore[arg-type]
    try:
        loop = asyncio.new_event_loop()
        q: asyncio.Queue[Update] = asyncio.Queue()
        aeng._streams["r"] = (loop, q)
        loop.close()
        aeng._dispatch([("r", Update(token=5))])
        assert "r" not in aeng._streams
        assert aeng._thread.is_alive()
    finally:
        aeng.shutdown()
