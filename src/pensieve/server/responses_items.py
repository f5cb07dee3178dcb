"""OpenAI's Responses API in Pensieve's chat terms: the request body, its ``input`` items as
chat messages, its tools and text format as the chat request's, and a chat completion's answer
as Responses output items and usage.

Items to messages::

    "text"                                   -> user message
    {type: message, role, content}           -> message of that role (input_text/output_text
                                                parts joined)
    {type: function_call, call_id, name,
     arguments}                              -> assistant message with that tool call (calls in
                                                a row, and text before them, form one message)
    {type: function_call_output, call_id,
     output}                                 -> tool message answering call_id

Everything else (images, files, reasoning items, built-in tools) is a 400 naming the item.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pensieve.server.errors import APIError

PASSED_TO_CHAT = ("top_k", "seed", "stop", "stop_token_ids", "min_p", "min_tokens",
                  "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos",
                  "logit_bias", "keep_alive_s", "priority", "retention_priority", "cache_salt",
                  "chat_template_kwargs", "user", "prompt_cache_key", "safety_identifier",
                  "skip_special_tokens", "include_stop_str_in_output",
                  "spaces_between_special_tokens", "truncate_prompt_tokens", "request_id")
"""Fields a Responses body may carry beyond OpenAI's own, passed to the chat request as they
are (vLLM's sampling extras and Pensieve's hints; the chat request checks them)."""


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``. Fields beyond the declared ones go to the chat request (those in
    :data:`PASSED_TO_CHAT`) or are a 400 naming them."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    """A system message before the input; not carried over by ``previous_response_id``."""
    previous_response_id: str | None = None
    """Continue the conversation (and its KV) where that stored response left it."""
    store: bool = True
    """Keep the response for ``previous_response_id`` and ``GET /v1/responses/{id}``."""
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    """``{"format": {"type": "text" | "json_object" | "json_schema", ...}}``."""
    include: list[str] | None = None
    metadata: dict[str, Any] | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    """Accepted empty or ``{"effort": null}`` only (the model's own thinking is not steered)."""
    service_tier: Literal["auto", "default"] | None = None
    background: Literal[False] | None = None


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of text parts",
                       param=f"{where}.content")
    parts = []
    for j, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text",
                                                            "text"):
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            raise APIError(400, f"{where}.content.{j}: only text parts are supported, got "
                           f"{kind!r}", param=f"{where}.content.{j}",
                           code="unsupported_parameter")
        parts.append(str(p.get("text", "")))
    return "".join(parts)


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    try:
        return {"id": str(item["call_id"]), "type": "function",
                "function": {"name": str(item["name"]), "arguments": str(item["arguments"])}}
    except KeyError as e:
        raise APIError(400, f"{where} needs {e.args[0]}", param=f"{where}.{e.args[0]}") from None


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a Responses ``input`` (see the module docstring)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role must be user, system, developer or "
                               f"assistant, got {role!r}", param=f"{where}.role")
            out.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = _function_call(item, where)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if "call_id" not in item:
                raise APIError(400, f"{where} needs call_id", param=f"{where}.call_id")
            output = item.get("output", "")
            text = output if isinstance(output, str) else _text_of(output, where)
            out.append({"role": "tool", "content": text, "tool_call_id": str(item["call_id"])})
        else:
            raise APIError(400, f"{where}: items of type {kind!r} are not supported by this "
                           "server", param=f"{where}.type", code="unsupported_parameter")
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's ``{"type": "function", "function": {...}}``."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise APIError(400, f"tools.{i}: tools of type {t.get('type')!r} are not supported "
                           "by this server (function tools only)", param=f"tools.{i}.type",
                           code="unsupported_parameter")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or "name" not in choice:
            raise APIError(400, "tool_choice: only none, auto, required or "
                           '{"type": "function", "name": ...} are supported',
                           param="tool_choice", code="unsupported_parameter")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise APIError(400, f"text.format.type {fmt.get('type')!r} is not supported",
                   param="text.format.type", code="unsupported_parameter")


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat answer's message as Responses output items: its reasoning, its text, its
    calls."""
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append({"type": "reasoning", "id": new_id("rs_"), "summary": [],
                      "content": [{"type": "reasoning_text",
                                   "text": message["reasoning_content"]}]})
    if message.get("content"):
        items.append(message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        items.append(function_call_item(call))
    return items


def message_item(text: str, status: str = "completed", item_id: str | None = None
                 ) -> dict[str, Any]:
    return {"type": "message", "id": item_id or new_id("msg_"), "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}] if status == "completed" else []}


def function_call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    fn = call["function"]
    return {"type": "function_call", "id": new_id("fc_"), "call_id": call["id"],
            "name": fn["name"], "arguments": fn["arguments"] if status == "completed" else "",
            "status": status}


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]
                                     ["cached_tokens"]},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def response_object(body: ResponsesRequest, rid: str, model: str, status: str,
                    output: list[dict[str, Any]], finish: str | None = None,
                    chat_usage: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Responses ``response`` object (OpenAI's shape; ``conversation_id`` and
    ``pensieve`` are added by the caller)."""
    incomplete = ({"reason": "max_output_tokens"} if finish == "length" else None)
    if incomplete is not None and status == "completed":
        status = "incomplete"
    return {"id": rid, "object": "response", "created_at": int(time.time()), "model": model,
            "status": status, "error": None, "incomplete_details": incomplete,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id, "store": body.store,
            "temperature": body.temperature, "top_p": body.top_p,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "truncation": body.truncation or "disabled", "reasoning": body.reasoning,
            "usage": usage(chat_usage), "user": (body.model_extra or {}).get("user")}

