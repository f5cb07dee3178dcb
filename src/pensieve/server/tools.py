"""Tool calling: the request's ``tools`` into the chat template, the history's tool calls and
results as messages, and the grammar that forces a schema-valid call.

Messages are kept (and stored, so a re-sent history finds its conversation) in one canonical
form: ``{"role", "content"}`` plus ``tool_calls`` (OpenAI's shape, ``arguments`` as JSON text)
on an assistant message that called tools and ``tool_call_id`` on a ``tool`` message.

Rendering. A template that handles tools itself (its source mentions ``tools``) gets them as
``tools=`` and the messages with each call's ``arguments`` parsed to an object, as HF templates
expect. Any other template gets the documented fallback: the tools described in the system
message (Hermes' prompt), each assistant call written as
``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` in its content, and each tool
result as a user message ``<tool_response>\\n...\\n</tool_response>``; calls are then read in
that format (:mod:`.tool_parsers`). The call text written back is the text the model wrote (the
name and compact JSON arguments, the spacing the constrained output uses), so the next turn's
rendering repeats the answer's tokens and its KV is reused.
"""

from __future__ import annotations

import json
from typing import Any

from pensieve.core.sampling_params import GrammarSpec

FALLBACK_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user "
    "query. Don't make assumptions about what values to plug into functions. Here are the "
    "available tools: <tools>{tools}</tools>\nFor each function call return a json object "
    "with function name and arguments within <tool_call></tool_call> XML tags as follows:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>"
)
"""The system text that describes the tools to a template without tool support."""

_WRAP = {"hermes": ("<tool_call>\n", "\n</tool_call>", "arguments"),
         "llama3": ("", "", "parameters"),
         "mistral": ("[TOOL_CALLS][", "]", "arguments")}
"""Per call format: the text before and after one call, and the arguments' key."""


def native_tools(template: str | None) -> bool:
    """Whether a chat template renders ``tools`` itself."""
    return template is not None and "tools" in template


def call_text(name: str, arguments: str) -> str:
    """One call in the Hermes format, as the constrained model writes it."""
    return f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, ' \
           f'"arguments": {arguments}}}\n</tool_call>'


def for_template(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 native: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Canonical messages -> (the messages the template gets, its extra keyword arguments)."""
    if native:
        out = [_parsed_args(m) for m in messages]
        return out, ({"tools": tools} if tools else {})
    out = [_fallback(m) for m in messages]
    if tools:
        desc = FALLBACK_SYSTEM.format(tools=json.dumps(tools, ensure_ascii=False))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + desc}
        else:
            out.insert(0, {"role": "system", "content": desc})
    return out, {}


def _parsed_args(m: dict[str, Any]) -> dict[str, Any]:
    if "tool_calls" not in m:
        return m
    calls = []
    for c in m["tool_calls"]:
        fn = dict(c["function"])
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except (TypeError, ValueError):
            pass  # the template gets the text as it came
        calls.append({**c, "function": fn})
    return {**m, "tool_calls": calls}


def _fallback(m: dict[str, Any]) -> dict[str, Any]:
    if m["role"] == "tool":
        return {"role": "user",
                "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
    if "tool_calls" in m:
        calls = "\n".join(call_text(c["function"]["name"], c["function"]["arguments"])
                          for c in m["tool_calls"])
        content = m["content"] + ("\n" if m["content"] else "") + calls
        return {"role": "assistant", "content": content}
    return {"role": m["role"], "content": m["content"]}


def forced_names(tools: list[dict[str, Any]], tool_choice: Any) -> list[str] | None:
    """The tools a call must name: all for ``required``, one for a named choice; None when
    the model may answer without calling (``auto``, ``none``). ValueError: a bad choice."""
    names = [t["function"]["name"] for t in tools]
    if tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        return names
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if not isinstance(name, str) or name not in names:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        return [name]
    raise ValueError(f"tool_choice must be none, auto, required or a named function, "
                     f"got {tool_choice!r}")


def call_grammar(tools: list[dict[str, Any]], names: list[str], parallel: bool,
                 fmt: str) -> GrammarSpec:
    """A structural tag that admits only calls of ``names`` in format ``fmt`` whose
    arguments follow each tool's parameter schema (one call, or several with ``parallel``)."""
    before, after, key = _WRAP[fmt]
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
               for t in tools}
    options = [{"type": "json_schema", "json_schema": _call_schema(n, key, schemas[n])}
               for n in names]
    one = _sequence([before, options[0] if len(options) == 1
                     else {"type": "or", "elements": options}, after])
    if parallel:
        sep = "\n" if fmt == "hermes" else "; " if fmt == "llama3" else ""
        one = _sequence([one, {"type": "star", "content": _sequence([sep, one])}])
    return GrammarSpec("structural_tag",
                       json.dumps({"type": "structural_tag", "format": one}))


DEFINITIONS = ("$defs", "definitions")
"""Where a schema keeps the subschemas its ``$ref`` names (``#/$defs/X``: what Pydantic
writes; ``#/definitions/X``: older generators)."""


def _call_schema(name: str, key: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """The schema of one call of ``name``: its arguments under ``key`` follow the tool's
    ``parameters``. A ``$ref`` of theirs names the tool's own definitions from its root, so
    those move to the call schema's root, where the reference now resolves."""
    params = dict(parameters)
    defs = {k: params.pop(k) for k in DEFINITIONS if k in params}
    return {"type": "object", "properties": {"name": {"const": name}, key: params},
            "required": ["name", key], "additionalProperties": False, **defs}


def _sequence(parts: list[Any]) -> dict[str, Any]:
    """A structural-tag sequence of formats and constant strings (empty strings left out)."""
    elements = [{"type": "const_string", "value": p} if isinstance(p, str) else p
                for p in parts if p != ""]
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}
