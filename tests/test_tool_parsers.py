"""Tool-call parsers, the fallback rendering of tools and calls, and the forced-call grammar
(compiled by xgrammar over a small byte-level tokenizer; no model)."""

from __future__ import annotations

import json

import pytest

from pensieve.server.tool_parsers import (
    parse_hermes,
    parse_llama3,
    parse_mistral,
    parser_for_template,
)
from pensieve.server.tools import call_grammar, call_text, for_template, forced_names

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_calls_and_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
            '</tool_call>')
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert _calls(calls) == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert calls[0].arguments == '{"city": "Paris"}'  # compact, as the grammar writes it


def test_hermes_plain_text_and_broken_calls():
    assert parse_hermes("Paris is sunny.") == ("Paris is sunny.", [])
    broken = '<tool_call>\n{"name": "add", "arguments": {"a": 1\n</tool_call>'
    assert parse_hermes(broken) == (broken, [])
    no_name = '<tool_call>\n{"arguments": {}}\n</tool_call>'
    assert parse_hermes(no_name) == (no_name, [])


def test_hermes_drops_only_a_cut_last_call():
    one = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    content, calls = parse_hermes(one + '\n<tool_call>\n{"name": "add", "argu')
    assert content == "" and _calls(calls) == [("add", {"a": 1})]


def test_llama3_json_and_python_tag():
    _, calls = parse_llama3('{"name": "add", "parameters": {"a": 1, "b": 2}}')
    assert _calls(calls) == [("add", {"a": 1, "b": 2})]
    _, calls = parse_llama3('<|python_tag|>{"name": "get_weather", "parameters": '
                            '{"city": "Rome"}}; {"name": "add", "parameters": {}}<|eom_id|>')
    assert _calls(calls) == [("get_weather", {"city": "Rome"}), ("add", {})]
    assert parse_llama3("The answer is {not json}") == ("The answer is {not json}", [])
    assert parse_llama3('{"a": 1}') == ('{"a": 1}', [])  # JSON, but not a call


def test_mistral_both_forms():
    content, calls = parse_mistral('Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 3}}, '
                                   '{"name": "get_weather", "arguments": {"city": "Oslo"}}]</s>')
    assert content == "Sure."
    assert _calls(calls) == [("add", {"a": 3}), ("get_weather", {"city": "Oslo"})]
    _, calls = parse_mistral('[TOOL_CALLS]add[ARGS]{"a": 5}')
    assert _calls(calls) == [("add", {"a": 5})]
    assert parse_mistral("[TOOL_CALLS] nonsense") == ("[TOOL_CALLS] nonsense", [])


def test_parser_for_template():
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("{{ '<|python_tag|>' }}") == "llama3"
    assert parser_for_template("{{ '<tool_call>' }}") == "hermes"
    assert parser_for_template(None) == "hermes"


def test_fallback_rendering_round_trips_a_call():
    call = {"id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    msgs = [{"role": "user", "content": "1+2?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "3", "tool_call_id": "call_1"}]
    out, extra = for_template(msgs, TOOLS, native=False)
    assert extra == {}
    assert out[0]["role"] == "system" and '"get_weather"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": call_text("add", '{"a": 1, "b": 2}')}
    assert out[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}
    # what the fallback writes is what the Hermes parser reads back
    _, calls = parse_hermes(out[2]["content"])
    assert calls[0].name == "add" and calls[0].arguments == '{"a": 1, "b": 2}'


def test_native_rendering_passes_tools_and_parsed_arguments():
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    out, extra = for_template([{"role": "assistant", "content": "", "tool_calls": [call]}],
                              TOOLS, native=True)
    assert extra == {"tools": TOOLS}
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}


def test_forced_names():
    assert forced_names(TOOLS, "auto") is None and forced_names(TOOLS, "none") is None
    assert forced_names(TOOLS, "required") == ["get_weather", "add"]
    named = {"type": "function", "function": {"name": "add"}}
    assert forced_names(TOOLS, named) == ["add"]
    with pytest.raises(ValueError, match="not among the tools"):
        forced_names(TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="tool_choice must be"):
        forced_names(TOOLS, "always")


@pytest.mark.parametrize("fmt,parse", [("hermes", parse_hermes), ("llama3", parse_llama3),
                                       ("mistral", parse_mistral)])
def test_call_grammar_accepts_exactly_valid_calls(fmt, parse):
    """The forced-call grammar matches a valid call of an allowed tool in the format (which
    the format's parser reads back), and refuses another tool or arguments off the schema."""
    xgr = pytest.importorskip("xgrammar")
    info = xgr.TokenizerInfo([chr(i) for i in range(32, 127)] + ["\n"])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    spec = call_grammar(TOOLS, ["get_weather"], parallel=False, fmt=fmt)
    compiled = compiler.compile_structural_tag(spec.source)
    key = "parameters" if fmt == "llama3" else "arguments"
    before, after = {"hermes": ("<tool_call>\n", "\n</tool_call>"), "llama3": ("", ""),
                     "mistral": ("[TOOL_CALLS][", "]")}[fmt]

    def accepts(text: str) -> bool:
        m = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return m.accept_string(text) and m.is_terminated()

    good = f'{before}{{"name": "get_weather", "{key}": {{"city": "Paris"}}}}{after}'
    assert accepts(good)
    assert _calls(parse(good)[1]) == [("get_weather", {"city": "Paris"})]
    assert not accepts(f'{before}{{"name": "add", "{key}": {{"a": 1}}}}{after}')
    assert not accepts(f'{before}{{"name": "get_weather", "{key}": {{"city": 3}}}}{after}')
    assert not accepts(f'{before}{{"name": "get_weather", "{key}": {{}}}}{after}')


class _Result:
    def __init__(self, text: str) -> None:
        self.text, self.output_ids = text, []


def _stream(fmt: str, pieces: list[str]):
    from pensieve.server.tool_answer import ToolAnswer

    ta = ToolAnswer(fmt, None)
    sent = [ta.feed(p) for p in pieces]
    result = _Result("".join(pieces))
    return sent, ta.last_content(result), ta.read(result)


def test_stream_sends_text_until_a_call_begins():
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    sent, last, (content, calls) = _stream("hermes", ["Let me ", "add. <tool", "_call>",
                                                      call[len("<tool_call>"):]])
    assert sent == ["Let me ", "add. ", "", ""]  # "<tool" held until it proved a marker
    assert last == "" and content == "Let me add." and calls[0]["function"]["name"] == "add"


def test_stream_releases_a_false_marker_and_a_broken_call():
    sent, last, (_, calls) = _stream("hermes", ["a <to", "y> b"])
    assert "".join(sent) + last == "a <toy> b" and sent[0] == "a " and not calls
    broken = ["<tool_call>", '\n{"name": 1}\n</tool_call>']
    sent, last, (content, calls) = _stream("hermes", broken)
    assert sent == ["", ""] and last == "".join(broken) == content and calls == []


def test_stream_holds_everything_for_special_token_formats():
    pieces = ['{"name": "add", ', '"parameters": {"a": 2}}']
    sent, last, (content, calls) = _stream("llama3", pieces)
    assert sent == ["", ""] and last == "" and calls[0]["function"]["arguments"] == '{"a": 2}'
    sent, last, _ = _stream("llama3", ["plain ", "text"])
    assert sent == ["", ""] and last == "plain text"


def test_parallel_tool_calls_false_keeps_the_first_call():
    from pensieve.server.tool_answer import ToolAnswer

    two = ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "X"}}\n</tool_call>')
    assert len(ToolAnswer("hermes", None).read(_Result(two))[1]) == 2
    calls = ToolAnswer("hermes", None, parallel=False).read(_Result(two))[1]
    assert [c["function"]["name"] for c in calls] == ["add"]
