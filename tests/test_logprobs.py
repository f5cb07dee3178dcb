"""Log-probabilities (``SamplingParams.logprobs``): the runner's against HF transformers' on the
tiny random Llama (fp32, 1e-4), through the engine (batched, a conversation's second turn
from the cache, greedy and seeded sampling) and through ``pensieve serve``'s OpenAI surface
(chat and completions, streamed and not, with the official client), and the 400s."""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from fastapi.testclient import TestClient
from server_scripted import build_tokenizer

from pensieve.core.sampling_params import SamplingParams
from pensieve.runner.sampler import sample, token_logprobs

TOL = 1e-4


def hf_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """``[len(ids), V]`` log-softmax of HF's logits at every position (fp32)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(dim=-1)


def test_sampling_params_logprobs_range() -> None:
    for ok in (None, 0, 5, 20):
        assert SamplingParams(logprobs=ok).logprobs == ok
    for bad in (-1, 21, 2.5, "3"):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)  # type: ignore[arg-type]


def test_token_logprobs_are_the_unscaled_log_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(),
              SamplingParams(temperature=0.5, top_k=5, seed=1, logprobs=0),
              SamplingParams(temperature=2.0, top_p=0.5, seed=2, logprobs=20)]
    before = logits.clone()
    tokens = sample(logits, params, [0, 0, 0, 0])
    assert torch.equal(logits, before)  # sampling leaves the logits as they were
    got = token_logprobs(logits, params, tokens)
    assert set(got) == {0, 2, 3}  # only the rows that ask
    ref = logits.log_softmax(dim=-1)
    for i, e in got.items():
        assert abs(e.logprob - ref[i, tokens[i]].item()) < 1e-6
        n = params[i].logprobs
        assert len(e.top) == n
        vals, ids = ref[i].topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [t for t, _ in e.top] == ids.tolist()
        assert all(abs(a - b) < 1e-6 for (_, a), b in zip(e.top, vals.tolist()))
    assert got[0].top[0][0] == tokens[0]  # greedy: the sampled token ranks first


def test_engine_logprobs_match_hf(tiny_llama: Any) -> None:
    from pensieve.engine.llm import build_engine_config
    from pensieve.engine.llm_engine import LLMEngine

    path, hf = tiny_llama
    cfg = build_engine_config(model=path, dtype="float32", device="cpu", chunk_size=8,
                              num_gpu_blocks=64, num_cpu_blocks=32, max_num_batched_tokens=64)
    engine = LLMEngine(cfg)
    prompts = {"g": [5, 17, 99, 3, 200, 41], "s": [7, 7, 8, 120, 9], "n": [1, 2, 3]}
    params = {"g": SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5),
              "s": SamplingParams(max_tokens=12, temperature=0.9, seed=3, ignore_eos=True,
                                  logprobs=2),
              "n": SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)}

    def run(turn: int) -> dict[str, Any]:
        for k, ids in prompts.items():
            engine.add_request(f"{k}{turn}", ids, params[k], conversation_id=k)
        outs = {}
        while engine.has_unfinished():
            for o in engine.step():
                outs[o.request_id[0]] = o
        return outs

    for turn in range(2):  # the second turn's history comes from the cache
        outs = run(turn)
        assert outs["n"].logprobs == []
        for k in ("g", "s"):
            o = outs[k]
            ids = o.prompt_token_ids + o.output_token_ids
            ref = hf_logprobs(hf, ids)
            assert len(o.logprobs) == len(o.output_token_ids) == 12
            p0 = len(o.prompt_token_ids) - 1
            for j, (tok, e) in enumerate(zip(o.output_token_ids, o.logprobs)):
                row = ref[p0 + j]
                assert e is not None and abs(e.logprob - row[tok].item()) < TOL, (k, j)
                lps = [lp for _, lp in e.top]
                assert len(e.top) == params[k].logprobs and lps == sorted(lps, reverse=True)
                for t, lp in e.top:
                    assert abs(lp - row[t].item()) < TOL
                assert [t for t, _ in e.top] == row.topk(len(e.top)).indices.tolist()
                if k == "g":
                    assert e.top[0][0] == tok
        if turn == 0:
            assert engine.cache.stats.as_dict().get("gpu_hit_tokens", 0) == 0
    assert engine.cache.stats.as_dict()["gpu_hit_tokens"] > 0
    engine.shutdown()


# ------------------------------------------------------------------ the OpenAI surface
@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Any]:
    """A tiny random Llama whose vocabulary is a small chat tokenizer's (saved with it)."""
    import transformers

    tok = build_tokenizer("chatml")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("chat_llama")
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path), model, tok


@pytest.fixture(scope="module")
def served(chat_llama: Any, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[TestClient, openai.OpenAI]]:
    from pensieve.server.main import add_serve_args, build_server

    p = argparse.ArgumentParser()
    add_serve_args(p)
    store = tmp_path_factory.mktemp("store") / "conv.db"
    args = p.parse_args([chat_llama[0], "--device", "cpu", "--dtype", "float32",
                         "--store", str(store), "--num-gpu-blocks", "64",
                         "--num-cpu-blocks", "32", "--max-model-len", "256",
                         "--chunk-size", "8", "--served-model-name", "chat_llama0"])
    app, close = build_server(args)
    with TestClient(app) as http:
        yield http, openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="k",
                                  http_client=http, max_retries=0)
    close()


def test_server_sets_its_thread_switch_interval(served: Any) -> None:
    """build_server applies --switch-interval-ms (here the default, 0.5 ms) to the process."""
    import sys

    assert sys.getswitchinterval() == pytest.approx(0.5e-3)


MSGS = [{"role": "user", "content": "Tell me about memory palaces."}]
N = 10


def _check_against_hf(model: Any, tok: Any, ids: list[int], n_prompt: int,
                      entries: list[tuple[str, float, list[tuple[str, float]]]]) -> None:
    """Each (token text, logprob, top alternatives) equals HF's at its position (greedy)."""
    ref = hf_logprobs(model, ids)
    assert len(entries) == len(ids) - n_prompt == N
    for j, (text, lp, top) in enumerate(entries):
        tid, row = ids[n_prompt + j], ref[n_prompt + j - 1]
        assert text == tok.decode([tid])
        assert abs(lp - row[tid].item()) < TOL
        lps = [v for _, v in top]
        assert lps == sorted(lps, reverse=True) and text in [t for t, _ in top]
        ref_top = row.topk(len(top))
        assert [t for t, _ in top] == [tok.decode([i]) for i in ref_top.indices.tolist()]
        assert all(abs(a - b) < TOL for a, b in zip(lps, ref_top.values.tolist()))


def _history(http: TestClient, cid: str) -> list[int]:
    return list(http.get(f"/v1/conversations/{cid}").json()["token_ids"])


def test_chat_logprobs_match_hf(served: Any, chat_llama: Any) -> None:
    http, client = served
    _, model, tok = chat_llama
    prompt = tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
    r = client.chat.completions.create(model="chat_llama0", messages=MSGS, max_tokens=N,
                                       temperature=0, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert all(list(c.token.encode()) == c.bytes and len(c.top_logprobs) == 3 for c in content)
    ids = _history(http, r.model_extra["conversation_id"])
    assert ids[:len(prompt)] == prompt
    _check_against_hf(model, tok, ids, len(prompt), [
        (c.token, c.logprob, [(a.token, a.logprob) for a in c.top_logprobs]) for c in content])
    # streamed: every token's entry arrives with the chunks, the same values
    chunks = list(client.chat.completions.create(
        model="chat_llama0", messages=MSGS, max_tokens=N, temperature=0, logprobs=True,
        top_logprobs=3, stream=True, extra_body={"ignore_eos": True}))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs
                for c in ch.choices[0].logprobs.content]
    assert [(c.token, c.top_logprobs[0].token) for c in streamed] == [
        (c.token, c.top_logprobs[0].token) for c in content]
    assert all(abs(a.logprob - b.logprob) < TOL for a, b in zip(streamed, content))
    assert "".join(c.token for c in streamed) == "".join(
        ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    # without logprobs (absent, or null as OpenAI's API allows): none
    r = client.chat.completions.create(model="chat_llama0", messages=MSGS, max_tokens=2)
    assert r.choices[0].logprobs is None
    r = client.chat.completions.create(model="chat_llama0", messages=MSGS, max_tokens=2,
                                       extra_body={"logprobs": None})
    assert r.choices[0].logprobs is None
    # logprobs without top_logprobs: the sampled token's only
    r = client.chat.completions.create(model="chat_llama0", messages=MSGS, max_tokens=2,
                                       logprobs=True)
    assert [len(c.top_logprobs) for c in r.choices[0].logprobs.content] == [0, 0]
    assert all(c.logprob <= 0 and math.isfinite(c.logprob) for c in r.choices[0].logprobs.content)


def test_completions_logprobs_match_hf(served: Any, chat_llama: Any) -> None:
    http, client = served
    _, model, tok = chat_llama
    prompt = list(tok.encode("Hello there, how", add_special_tokens=False))
    body = {"create_conversation": True, "ignore_eos": True}
    r = client.completions.create(model="chat_llama0", prompt=prompt, max_tokens=N,
                                  temperature=0, logprobs=2, extra_body=body)
    lp = r.choices[0].logprobs
    ids = _history(http, r.model_extra["conversation_id"])
    assert len(lp.top_logprobs) == N and all(len(t) == 2 for t in lp.top_logprobs)
    _check_against_hf(model, tok, ids, len(prompt), [
        (t, v, sorted(top.items(), key=lambda kv: -kv[1]))
        for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(N)]
    chunks = list(client.completions.create(model="chat_llama0", prompt=prompt, max_tokens=N,
                                            temperature=0, logprobs=2, stream=True,
                                            extra_body={"ignore_eos": True}))
    got: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for ch in chunks:
        if ch.choices and ch.choices[0].logprobs:
            for k in got:
                got[k] += getattr(ch.choices[0].logprobs, k)
    assert got["tokens"] == lp.tokens and got["text_offset"] == lp.text_offset
    assert all(abs(a - b) < TOL for a, b in zip(got["token_logprobs"], lp.token_logprobs))
    # logprobs=0: the sampled token alone in top_logprobs, as vLLM
    r = client.completions.create(model="chat_llama0", prompt=prompt, max_tokens=2, logprobs=0)
    lp = r.choices[0].logprobs
    assert [list(t) for t in lp.top_logprobs] == [[t] for t in lp.tokens]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"top_logprobs": 2}, "top_logprobs"),
])
def test_bad_logprobs_are_400(served: Any, path: str, body: dict[str, Any],
                              param: str) -> None:
    http, _ = served
    base = ({"messages": MSGS} if "chat" in path else {"prompt": [1, 2, 3]})
    r = http.post(path, json={**base, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
