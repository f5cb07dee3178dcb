"""``/v1/responses`` with the official ``openai`` client on the default model, greedy: a turn
continued by ``previous_response_id`` runs in the same conversation, reuses its KV (the cached
tokens cover the whole earlier turn) and answers as chat completions does on the whole
history; streaming gives the same text and a continuable response; a function-tool loop goes
through items; ``store: false`` responses cannot be continued; bad input is a 400 naming the
field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

MODEL = "smollm2-135m-instruct"
TOOL = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(smollm2_server):
    """The default model's server of this test process (conftest.py's ``smollm2_server``:
    ``--max-model-len 2048``, its defaults otherwise), shared with the other modules on it."""
    return smollm2_server


def _ask(client: openai.OpenAI, max_output_tokens: int = 24, **kw):
    return client.responses.create(model=MODEL, temperature=0,
                                   max_output_tokens=max_output_tokens, **kw)


def test_previous_response_id_continues_conversation_and_kv(server):
    client = server.client()
    r1 = _ask(client, input="What is the capital of France?", instructions="Answer briefly.")
    assert r1.status in ("completed", "incomplete") and r1.output_text
    assert r1.output[0].type == "message" and r1.instructions == "Answer briefly."
    r2 = _ask(client, input="And of Germany?", previous_response_id=r1.id,
              instructions="Answer briefly.")
    extra1, extra2 = r1.model_extra or {}, r2.model_extra or {}
    assert extra2["conversation_id"] == extra1["conversation_id"]  # the same conversation
    # turn 1's whole context is cached: its prompt and all but the last answer token
    turn1 = r1.usage.input_tokens + r1.usage.output_tokens - 1
    assert r2.usage.input_tokens_details.cached_tokens >= turn1 - turn1 % 32 > 0
    assert r2.usage.input_tokens > turn1
    # the same answer as chat completions given the whole history
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=24, messages=[
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": "And of Germany?"}])
    assert chat.choices[0].message.content == r2.output_text
    got = httpx.get(f"{server.url}/v1/responses/{r2.id}").json()
    assert got["id"] == r2.id and got["output"][0]["content"][0]["text"] == r2.output_text


def test_stream_gives_same_text_and_continues(server):
    client = server.client()
    plain = _ask(client, input="Name a color.")
    events = list(_ask(client, input="Name a color.", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == plain.output_text
    r2 = _ask(client, input="Another one?", previous_response_id=final.id)
    assert r2.usage.input_tokens_details.cached_tokens >= 32
    assert (r2.model_extra or {})["conversation_id"] == (final.model_extra or {})[
        "conversation_id"]


def test_function_tool_loop_through_items(server):
    client = server.client()
    r1 = _ask(client, input="What's the weather in Paris?", tools=[TOOL],
              tool_choice="required", max_output_tokens=96, parallel_tool_calls=False)
    calls = [o for o in r1.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    r2 = _ask(client, previous_response_id=r1.id, tools=[TOOL], input=[
        {"type": "function_call_output", "call_id": calls[0].call_id,
         "output": '{"temperature_c": 21, "sky": "clear"}'}])
    assert r2.output_text and r2.output[-1].type == "message"
    assert r2.usage.input_tokens_details.cached_tokens >= 32
    # streamed, the call comes as a function_call item with its arguments
    events = list(_ask(client, input="What's the weather in Rome?", tools=[TOOL],
                       tool_choice="required", stream=True, max_output_tokens=96,
                       parallel_tool_calls=False))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in done] == ["function_call"] and done[0].name == "get_weather"
    args = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert args == [done[0].arguments]


def test_store_false_and_errors(server):
    client = server.client()
    r = _ask(client, input="Hi", store=False)
    with pytest.raises(openai.NotFoundError) as e:
        _ask(client, input="Again", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    for extra, param in (({"frobnicate": 1}, "frobnicate"),
                         ({"include": ["file_search_call.results"]}, "include")):
        with pytest.raises(openai.BadRequestError) as e:
            _ask(client, input="Hi", extra_body=extra)
        assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, input=[{"type": "message", "role": "user", "content": [
            {"type": "input_image", "image_url": "http://x/y.png"}]}])
    assert e.value.body["param"] == "input.0.content.0"
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, input="Hi", tools=[{"type": "web_search"}])
    assert e.value.body["param"] == "tools.0.type"


def test_agents_sdk_tool_loop_reuses_kv(server):
    """The OpenAI Agents SDK, its default model set-up (the Responses API) pointed at the
    server: a one-tool agent loop completes, and its second model call continues the first
    response (``previous_response_id``) with the first call's KV."""
    import agents  # the dev extra's openai-agents
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        seen.append(city)
        return f"It is sunny and 21 C in {city}."

    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(openai.AsyncOpenAI(base_url=server.url + "/v1",
                                                        api_key="none", max_retries=0))
    agents.set_default_openai_api("responses")
    agent = agents.Agent(name="weather", instructions="Use the tool to answer.", model=MODEL,
                         tools=[get_weather], tool_use_behavior="run_llm_again",
                         model_settings=agents.ModelSettings(
                             temperature=0, max_tokens=96, tool_choice="required",
                             parallel_tool_calls=False, reset_tool_choice=True))
    result = agents.Runner.run_sync(agent, "What's the weather in Paris?", max_turns=4,
                                    auto_previous_response_id=True)
    assert seen and result.final_output
    first, last = result.raw_responses[0], result.raw_responses[-1]
    assert len(result.raw_responses) >= 2
    cached = last.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens - first.usage.input_tokens % 32 > 0
    stored = [httpx.get(f"{server.url}/v1/responses/{r.response_id}").json()
              for r in (first, last)]
    assert stored[1]["previous_response_id"] is not None  # chained, not re-sent
    assert stored[1]["conversation_id"] == stored[0]["conversation_id"]
