"""vLLM's extra request fields through the ``openai`` client's ``extra_body``, on the default
model, greedy, each against its vLLM meaning: ``include_stop_str_in_output`` keeps the stop
string, ``skip_special_tokens: false`` shows special tokens (but not the ending stop token
unless ``include_stop_str_in_output``), ``truncate_prompt_tokens`` feeds only the last k
tokens, ``request_id`` names the response, ``priority: 0`` is accepted (an integer; a fraction
is a 400), and OpenAI's ``safety_identifier``/``verbosity``/``prompt_cache_key`` are accepted
and counted on /metrics."""

from __future__ import annotations

import openai
import pytest

MODEL = "smollm2-135m-instruct"
IM_START = 1  # SmolLM2's <|im_start|>


@pytest.fixture(scope="module")
def server(smollm2_server):
    """The default model's server of this test process (conftest.py's ``smollm2_server``:
    ``--max-model-len 2048``, its defaults otherwise), shared with the other modules on it."""
    return smollm2_server


def _complete(client: openai.OpenAI, prompt, **extra):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                     extra_body=extra or None)


def test_include_stop_str_in_output(server):
    client = server.client()
    text = _complete(client, "The capital of France is").choices[0].text
    stop = text.strip()[:3]
    at = text.index(stop)
    cut = client.completions.create(model=MODEL, prompt="The capital of France is",
                                    max_tokens=8, temperature=0, stop=[stop])
    kept = client.completions.create(model=MODEL, prompt="The capital of France is",
                                     max_tokens=8, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert cut.choices[0].text == text[:at]
    assert kept.choices[0].text == text[:at + len(stop)]
    assert cut.choices[0].finish_reason == kept.choices[0].finish_reason == "stop"


def test_skip_special_tokens_false_shows_them(server):
    client = server.client()
    forced = {"logit_bias": {str(IM_START): 100}, "max_tokens": 2}
    r = client.completions.create(model=MODEL, prompt="Hello", temperature=0, **forced)
    assert r.choices[0].text == ""
    r = client.completions.create(model=MODEL, prompt="Hello", temperature=0, **forced,
                                  extra_body={"skip_special_tokens": False})
    assert r.choices[0].text == "<|im_start|><|im_start|>"
    msgs = [{"role": "user", "content": "Say hi."}]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                           max_tokens=64)
    assert plain.choices[0].finish_reason == "stop"  # on <|im_end|>
    shown = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                           max_tokens=64,
                                           extra_body={"skip_special_tokens": False})
    assert shown.choices[0].message.content == plain.choices[0].message.content
    kept = client.chat.completions.create(
        model=MODEL, messages=msgs, temperature=0, max_tokens=64,
        extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True})
    assert kept.choices[0].message.content == plain.choices[0].message.content + "<|im_end|>"


def test_truncate_prompt_tokens_keeps_the_last_k(server):
    client = server.client()
    ids = client.post("/../tokenize", body={"prompt": "One two three four five six seven "
                                            "eight nine ten eleven twelve thirteen"},
                      cast_to=object)["tokens"]
    assert len(ids) > 10
    short = _complete(client, ids[-6:])
    cut = _complete(client, ids, truncate_prompt_tokens=6)
    assert cut.usage.prompt_tokens == 6 and cut.choices[0].text == short.choices[0].text


def test_request_id_priority_and_recorded_fields(server):
    client = server.client()
    assert _complete(client, "Hi", request_id="abc-1").id == "cmpl-abc-1"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                  "content": "Hi"}],
                                          max_tokens=2, extra_body={"request_id": "abc-2"})
    assert chat.id == "chatcmpl-abc-2"
    for p in (0, -3, 7):
        assert _complete(client, "Hi", priority=p).choices[0].text is not None
    with pytest.raises(openai.BadRequestError) as e:
        _complete(client, "Hi", priority=0.5)
    assert e.value.body["param"] == "priority"
    _complete(client, "Hi", safety_identifier="user-9", verbosity="low",
              prompt_cache_key="k1")
    for field in ("safety_identifier", "verbosity", "prompt_cache_key"):
        assert server.metric(f'pensieve_recorded_fields_total{{field="{field}"}}') >= 1
    with pytest.raises(openai.BadRequestError) as e:
        _complete(client, "Hi", verbosity="loud")
    assert e.value.body["param"] == "verbosity"


def test_template_fields_render_as_apply_chat_template(server):
    import transformers

    from pensieve.models.builtin import ensure_smollm2_checkpoint

    tok = transformers.AutoTokenizer.from_pretrained(ensure_smollm2_checkpoint(),
                                                     local_files_only=True)
    client = server.client()
    msgs = [{"role": "user", "content": "Count to five."},
            {"role": "assistant", "content": "One, two,"}]
    docs = [{"title": "a", "text": "Numbers go up."}]
    for extra, kw in (({"continue_final_message": True, "add_generation_prompt": False},
                       {"continue_final_message": True, "add_generation_prompt": False}),
                      ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
                      ({"documents": docs}, {"add_generation_prompt": True, "documents": docs})):
        want = tok.apply_chat_template(msgs + ([] if "continue_final_message" in extra else
                                               [{"role": "user", "content": "Go on."}]),
                                       tokenize=True, return_dict=True, **kw)["input_ids"]
        sent = msgs + ([] if "continue_final_message" in extra else
                       [{"role": "user", "content": "Go on."}])
        r = client.chat.completions.create(model=MODEL, messages=sent, max_tokens=4,
                                           temperature=0, extra_body=extra)
        assert r.usage.prompt_tokens == len(want), extra
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=msgs[:1], max_tokens=2,
                                       extra_body={"continue_final_message": True})
    assert e.value.body["param"] == "continue_final_message"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=msgs[:1], max_tokens=2,
                                       extra_body={"chat_template": "{{ messages }}"})
    assert e.value.body["param"] == "chat_template"
