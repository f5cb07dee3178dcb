"""Tool-call parsers: a model's raw answer (special tokens kept) -> (content, calls).

One parser per output format, in :data:`PARSERS`, chosen by :func:`parser_for_template` from
the chat template's text:

========== ================================================================ ================
name       the model writes                                                 families
========== ================================================================ ================
hermes     ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``  Hermes, Qwen2.5,
                                                                            Qwen3; fallback
llama3     ``<|python_tag|>`` (optional) ``{"name": ..., "parameters": ...}`` Llama 3.1-3.3
           (several joined by ``;``)
mistral    ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or      Mistral
           ``[TOOL_CALLS]name[ARGS]{...}`` (v11 tokenizers)
========== ================================================================ ================

A template that knows none of these (SmolLM2-135M-Instruct's, the plain default) is given the
Hermes format by :mod:`.tools` (tools described in the system message). A call's
``arguments`` is returned as compact JSON text (``json.dumps`` with ``", "``/``": "``, the
spacing the grammar-constrained output uses), so the next turn re-renders the same text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments as JSON text (an object)."""
    id: str = ""

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id or "call_" + uuid.uuid4().hex[:24],
                             "type": "function",
                             "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


def _call(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    """A call from ``{"name": str, args_key: object}`` (``arguments`` may be JSON text)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_prefix(text: str) -> tuple[Any, int] | None:
    """The JSON value at the start of ``text`` (after whitespace) and where it ends."""
    start = len(text) - len(text.lstrip())
    try:
        return json.JSONDecoder().raw_decode(text, start)
    except json.JSONDecodeError:
        return None


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls: list[ToolCall] = []
    for m in _HERMES.finditer(text, start):
        found = _json_prefix(m.group(1))
        call = _call(found[0]) if found else None
        if call is None:
            if calls and m.end() == len(text) and not m.group(0).endswith("</tool_call>"):
                break  # a last call cut short (at max_tokens) after complete ones: dropped
            return text, []  # not a well-formed call: the answer is plain text
        calls.append(call)
    return text[:start].strip(), calls


def parse_llama3(text: str) -> tuple[str, list[ToolCall]]:
    body = text.split("<|python_tag|>", 1)[1] if "<|python_tag|>" in text else text
    body = body.strip()
    if not body.startswith("{"):
        return text, []
    calls: list[ToolCall] = []
    pos = 0
    while pos < len(body):
        found = _json_prefix(body[pos:])
        call = _call(found[0], "parameters") if found else None
        if found is None or call is None:
            return text, []
        calls.append(call)
        pos += found[1]
        rest = body[pos:].lstrip()
        if not rest.startswith(";"):
            if rest.strip() not in ("", "<|eom_id|>", "<|eot_id|>"):
                return text, []
            break
        pos = len(body) - len(rest) + 1
    return "", calls


def parse_mistral(text: str) -> tuple[str, list[ToolCall]]:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return text, []
    content, calls = text[:start].strip(), list[ToolCall]()
    for part in text[start:].split("[TOOL_CALLS]")[1:]:
        part = part.strip().removesuffix("</s>")
        if "[ARGS]" in part:  # name[ARGS]{...}
            name, args = part.split("[ARGS]", 1)
            found = _json_prefix(args)
            call = _call({"name": name.strip(), "arguments": found[0]}) if found else None
            if call is None:
                return text, []
            calls.append(call)
            continue
        found = _json_prefix(part)
        items = found[0] if found else None
        items = [items] if isinstance(items, dict) else items
        if not isinstance(items, list) or not items:
            return text, []
        for obj in items:
            call = _call(obj)
            if call is None:
                return text, []
            calls.append(call)
    return content, calls


PARSERS: dict[str, Callable[[str], tuple[str, list[ToolCall]]]] = {
    "hermes": parse_hermes, "llama3": parse_llama3, "mistral": parse_mistral}
"""Tool-call parsers by name: raw answer text -> (content before the calls, calls)."""


def parser_for_template(template: str | None) -> str:
    """The format a chat template's model writes calls in (``hermes`` when it shows none)."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or ("ipython" in t and "<|eot_id|>" in t):
        return "llama3"
    return "hermes"
