"""A stop string ends a turn as a stop token would: the engine finishes the request (its KV
kept, not aborted and recomputed), the history becomes the context plus the tokens up to the
one that completed the stop string, and the next turn reuses that KV while the model still
sees exactly the chat template of the messages."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from server_scripted import ScriptedExecutor, build_tokenizer, scripted_app, scripted_engine

from pensieve.core.outputs import RunnerOutput, SchedulerOutput
from pensieve.core.sampling_params import SamplingParams
from pensieve.engine.executor import TierSizes


class Slow:
    """A scripted executor whose steps take ``step_s``: a turn is still running when the
    server matches a stop string on its text."""

    def __init__(self, inner: ScriptedExecutor, step_s: float = 0.02) -> None:
        self.inner, self.step_s = inner, step_s

    @property
    def tiers(self) -> TierSizes:
        return self.inner.tiers

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        time.sleep(self.step_s)
        return self.inner.execute(sched)

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def shutdown(self) -> None:
        pass


def _enc(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_stop_string_keeps_the_turn_kv(stream: bool, tmp_path: Path) -> None:
    tok = build_tokenizer("chatml")
    app, ex = scripted_app(tok, tmp_path / "conv.db", wrap=Slow)
    eng = app.state.pensieve.engine.engine
    eng.audit = True
    # the answer goes on for 40 more tokens after the stop string (no EOS)
    ex.script, ex.filler = _enc(tok, " Sure. END more words"), _enc(tok, " Okay.")[0]
    msgs = [{"role": "user", "content": "Hi"}]
    with TestClient(app) as http:
        client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="k",
                               http_client=http, max_retries=0)
        if stream:
            text, cid = "", None
            for chunk in client.chat.completions.create(model="scripted", messages=msgs,
                                                        stop=" END", max_tokens=48,
                                                        stream=True):
                text += chunk.choices[0].delta.content or ""
                cid = chunk.model_extra["conversation_id"]
                finish = chunk.choices[0].finish_reason
        else:
            r = client.chat.completions.create(model="scripted", messages=msgs, stop=" END",
                                               max_tokens=48)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
            cid = r.model_extra["conversation_id"]
        assert text == " Sure." and finish == "stop"
        ctx1 = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
        # the history: the context and the tokens up to the one that completed " END"
        stored = http.get(f"/v1/conversations/{cid}").json()["token_ids"]
        assert stored == ctx1 + _enc(tok, " Sure. END")
        assert app.state.pensieve.engine.engine.conversation_history(cid) == stored
        assert not eng.has_unfinished()  # finished, not left running to max_tokens
        assert eng.cache_stats()["gpu_blocks_free"] < eng.cache.gpu.num_blocks  # KV kept

        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "And?"}]
        ex.script = _enc(tok, " Done.") + [tok.eos_token_id]
        r2 = client.chat.completions.create(model="scripted", messages=msgs, max_tokens=40)
        assert r2.model_extra["conversation_id"] != cid  # a new conversation over its KV
        ctx2 = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
        assert ex.seen[-1] == ctx2  # token-exact
        # reused: the KV of the context and of the answer up to where the template differs
        keep = _common_prefix_len(stored, ctx2)
        assert keep > len(ctx1)
        assert r2.usage.prompt_tokens_details.cached_tokens == keep
        assert ex.computed[-1] == len(ctx2) - keep
    app.state.pensieve.engine.shutdown()


def test_finish_request_ends_a_running_turn_and_aborts_a_waiting_one() -> None:
    eng, ex = scripted_engine(400, (2,))
    eng.audit = True
    ex.script, ex.filler = [11, 12, 13], 14
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    eng.add_request("t1", list(range(20, 40)), params, conversation_id="c")
    while len(eng.scheduler.requests["t1"].output_token_ids) < 5:
        assert not eng.step()
    out = list(eng.scheduler.requests["t1"].output_token_ids)
    eng.finish_request("t1")
    assert not eng.has_unfinished() and "t1" not in eng.scheduler.requests
    history = eng.conversation_history("c")
    assert history == list(range(20, 40)) + out
    conv = eng.cache.conversations["c"]
    assert conv.kv_end == len(history) - 1  # the last sampled token was never fed
    eng.cache.check_integrity()

    # the next turn computes only its new tokens and the one token without KV
    eng.add_request("t2", [50, 51], SamplingParams(max_tokens=2, ignore_eos=True),
                    conversation_id="c")
    (o,) = [o for _ in range(50) for o in eng.step()]
    assert o.cache_stats["gpu_hit_tokens"] == len(history) - 1
    assert ex.computed[-1] == 3

    # a turn not yet running is aborted: the conversation stays as it was
    before = eng.conversation_history("c")
    eng.add_request("t3", [60], params, conversation_id="c")
    eng.finish_request("t3")
    assert not eng.has_unfinished() and eng.conversation_history("c") == before
    eng.finish_request("t3")  # finished or unknown: nothing happens
    eng.cache.check_integrity()
