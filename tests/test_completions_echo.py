"""``/v1/completions`` as lm-evaluation-harness drives it, on the default model (fp32, CPU):
``echo`` with ``logprobs`` gives every prompt token's log-probability from the prefill itself,
equal to HF transformers' to 1e-3, across a prefill split over steps (a budget of 64 tokens
per step); a second identical request is scored again (its own cache salt), not skipped as
cached; batched prompts (strings, token lists) come back in order and equal single requests;
bad prompts are 400s naming ``prompt``."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
import transformers
from server_util import Server

from pensieve.models.builtin import ensure_smollm2_checkpoint

MODEL = "smollm2-135m-instruct"
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based inks and a wooden screw press. "
        "Within decades, presses spread from Mainz to more than two hundred cities across "
        "Europe, and the price of books fell sharply. Scholars could now compare identical "
        "copies of a text, which changed how knowledge was checked and shared. The question "
        "is whether the answer is")


@pytest.fixture(scope="module")
def hf_model(smollm2_cache):
    path = ensure_smollm2_checkpoint()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    return hf, tok


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_cache):
    s = Server(tmp_path_factory.mktemp("store") / "store.db", smollm2_cache, "--max-model-len",
               "2048", model=MODEL, budget=64)
    yield s
    s.stop()


def _echo(client: openai.OpenAI, prompt, **kw):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True,
                                     logprobs=1, temperature=0, **kw)


@torch.no_grad()
def test_echo_prompt_logprobs_match_hf(server, hf_model):
    hf, tok = hf_model
    ids = tok.encode(TEXT)
    assert len(ids) > 64  # the prefill spans several steps
    lp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [T, V]
    want = [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]
    client = server.client()
    for _ in range(2):  # the second is not a cache hit that skips the positions
        r = _echo(client, TEXT)
        c = r.choices[0]
        assert c.text.startswith(TEXT) and len(c.text) > len(TEXT)
        got = c.logprobs.token_logprobs
        assert len(got) == len(ids) + 1 and got[0] is None and c.logprobs.top_logprobs[0] is None
        assert max(abs(a - b) for a, b in zip(got[1:len(ids)], want)) < 1e-3
        for i in range(1, len(ids)):  # the most likely alternative, as HF ranks it
            top = c.logprobs.top_logprobs[i]
            best = int(lp[i - 1].argmax())
            assert abs(top[tok.decode([best])] - lp[i - 1, best].item()) < 1e-3
        # the answer token's logprob follows the prompt's
        nxt = int(lp[-1].argmax())
        assert abs(got[-1] - lp[-1, nxt].item()) < 1e-3
        assert c.logprobs.tokens[:len(ids)] == [tok.decode([t]) for t in ids]
    # as token ids, batched ([[ids]] is lm-eval's default), the same values
    b = _echo(client, [ids, ids[:40]])
    assert [c.index for c in b.choices] == [0, 1]
    assert b.choices[0].logprobs.token_logprobs == pytest.approx(got, abs=1e-5)
    assert len(b.choices[1].logprobs.token_logprobs) == 41
    assert b.choices[1].logprobs.token_logprobs[1:40] == pytest.approx(want[:39], abs=1e-3)


def test_batched_prompts_in_order(server):
    client = server.client()
    prompts = ["The capital of France is", "One, two, three,", "Water boils at"]
    single = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
              for p in prompts]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6,
                                      temperature=0, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    for i, s in enumerate(single):
        assert batch.choices[2 * i].text == batch.choices[2 * i + 1].text == s.choices[0].text
    assert batch.usage.prompt_tokens == 2 * sum(s.usage.prompt_tokens for s in single) // 2


@pytest.mark.parametrize("prompt,param", [
    ([], "prompt"), ([""], "prompt"), ([[1, 2], "x"], "prompt"), ([[]], "prompt"),
    ({"a": 1}, "prompt"), ([1, "x"], "prompt")])
def test_bad_prompts_name_prompt(server, prompt, param):
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": prompt})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_echo_refusals(server):
    for extra, param in (({"stream": True}, "stream"), ({"n": 2}, "n")):
        r = httpx.post(server.url + "/v1/completions", json={
            "model": MODEL, "prompt": "Hi", "echo": True, "logprobs": 1, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(server.url + "/v1/completions", json={
        "model": MODEL, "prompt": ["a", "b"], "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream", r.text
