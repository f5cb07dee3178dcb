"""Tool calls and structured output over HTTP with the official ``openai`` client, on the
default model (SmolLM2-135M-Instruct, whose template has no tool support: the Hermes
fallback), greedy: forced calls name a given tool and validate, streaming gives the same
calls, a 3-round tool loop reuses the KV each round, ``json_schema`` answers validate, and bad
schemas or tool choices are 400s."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

MODEL = "smollm2-135m-instruct"
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "maxLength": 60},
            "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
            "required": ["query"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = [
    "What's the weather in Paris?", "Add 2 and 3.", "Search for the tallest mountain.",
    "Is it raining in London?", "What is 17 plus 25?", "Find recipes for pancakes.",
    "Temperature in Tokyo in fahrenheit?", "Sum 100 and -7.", "Look up the Python release notes.",
    "Who won the 2018 World Cup?",
]
"""Three of each tool's kind (a unit, a negative number among them) and one that fits none:
each forced answer is a grammar-constrained generation of up to 96 tokens on the default
model, the module's main cost (20 prompts took 162 s of a loaded 2-core machine)."""


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


def _ask(client: openai.OpenAI, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                          temperature=0, max_tokens=96, **kw)


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def test_required_calls_name_a_tool_and_validate(server):
    """10 prompts, ``tool_choice="required"``: each answer is calls of the given tools whose
    arguments validate against their schemas."""
    client = server.client()
    with ThreadPoolExecutor(8) as pool:  # concurrent: they share batches
        answers = list(pool.map(lambda p: _ask(client, [{"role": "user", "content": p}],
                                               tool_choice="required",
                                               parallel_tool_calls=False), PROMPTS))
    for prompt, r in zip(PROMPTS, answers):
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (prompt, choice)
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        for name, args in _calls(choice.message):
            assert name in SCHEMAS, prompt
            jsonschema.validate(args, SCHEMAS[name])
    names = {_calls(r.choices[0].message)[0][0] for r in answers}
    assert len(names) >= 2  # the model picks among the tools, not always the first


def _streamed(stream) -> tuple[str, list[tuple[int, str | None, str | None]], str | None]:
    """A streamed answer: its content, its tool-call deltas (index, name, arguments text) in
    order and its finish reason."""
    content, deltas, finish = "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        deltas += [(tc.index, tc.function.name, tc.function.arguments)
                   for tc in delta.tool_calls or []]
        finish = chunk.choices[0].finish_reason or finish
    return content, deltas, finish


def _plain_and_streamed(client, asks: list[tuple[list, dict]]) -> list[tuple]:
    """Each ``(messages, kw)`` asked plainly and streamed, all at once (they share the
    engine's steps, as the sequential requests did not): ``(plain choice, streamed content,
    tool-call deltas, finish)`` each."""
    def plain(ask):
        return _ask(client, ask[0], **ask[1]).choices[0]

    def streamed(ask):
        return _streamed(_ask(client, ask[0], stream=True, **ask[1]))

    with ThreadPoolExecutor(2 * len(asks)) as pool:
        plains = [pool.submit(plain, a) for a in asks]
        streams = [pool.submit(streamed, a) for a in asks]
        return [(p.result(), *s.result()) for p, s in zip(plains, streams)]


def test_named_choice_and_streaming_give_the_same_calls(server):
    named = {"type": "function", "function": {"name": "search"}}
    choices = ["required", named]
    asks = [([{"role": "user", "content": p}], {"tool_choice": c})
            for p, c in zip(PROMPTS, choices)]
    for choice, (plain, _, deltas, finish) in zip(choices, _plain_and_streamed(server.client(),
                                                                               asks)):
        calls: dict[int, dict] = {}
        for index, name, arguments in deltas:
            c = calls.setdefault(index, {"name": "", "arguments": ""})
            c["name"] += name or ""
            c["arguments"] += arguments or ""
        streamed = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
        assert streamed == _calls(plain.message) and streamed
        assert finish == plain.finish_reason
        if choice is named:
            assert {n for n, _ in streamed} == {"search"}


def test_three_round_tool_loop_reuses_the_kv(server):
    """Each round re-sends the history with the call and its result: the conversation is
    found and the KV of the earlier rounds is reused (cached_tokens > 0 every round)."""
    client = server.client()
    messages = [{"role": "user", "content": "What's the weather in Paris, then in Rome, "
                                            "then in Berlin?"}]
    prev_prompt = 0
    for rnd in range(3):
        r = _ask(client, messages, tool_choice="required", parallel_tool_calls=False)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls"
        cached = r.usage.prompt_tokens_details.cached_tokens
        if rnd > 0:
            assert cached >= prev_prompt, (rnd, cached, prev_prompt)  # all earlier context
        prev_prompt = r.usage.prompt_tokens
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": json.dumps({"temperature": 20 + rnd})})
    final = _ask(client, messages, tool_choice="none")
    assert final.usage.prompt_tokens_details.cached_tokens >= prev_prompt
    assert final.choices[0].message.tool_calls is None


def test_json_schema_answers_validate(server):
    client = server.client()
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
        "required": ["name", "age", "tags"], "additionalProperties": False}
    for strict in (True, False):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe a person."}],
            temperature=0, max_tokens=120, response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": schema, "strict": strict}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about cats."}],
        temperature=0, max_tokens=120, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("kw,param,words", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "objectx"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ({"tools": [{"type": "function", "function": {"name": "bad", "parameters": {
        "type": "object", "properties": {"x": {"type": "wat"}}}}}],
      "tool_choice": "required"}, "tools", "wat"),
])
def test_bad_constraints_are_400s(server, kw, param, words):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4, **kw)
    err = e.value.body
    assert err["param"] == param and words in err["message"], err


def test_auto_streams_the_same_answer(server):
    """``tool_choice="auto"``: the model may answer or call; streamed, the held answer comes
    out as the same content or the same calls, with the same finish reason."""
    asks = [([{"role": "user", "content": p}], {"tool_choice": "auto"})
            for p in ("Hi! How are you today?", PROMPTS[2])]
    for plain, content, deltas, finish in _plain_and_streamed(server.client(), asks):
        calls = {index: (name, json.loads(arguments)) for index, name, arguments in deltas}
        assert finish == plain.finish_reason
        if plain.message.tool_calls:
            assert [calls[i] for i in sorted(calls)] == _calls(plain.message)
        else:
            assert content == plain.message.content and not calls


def test_n_above_one_with_tools_is_400(server):
    """Choices of a tool turn would not be read for calls: refused rather than ignored."""
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(
            model=MODEL, n=2, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
            tools=[TOOLS[0]])
    assert e.value.body["param"] == "n"
