"""Which request fields the API honours, and the 400 for every other one.

A field a body sends is one of:

- **honoured**: declared on the request's pydantic model (:mod:`.protocol`) and acted on;
- **inert only**: not implemented, accepted only with the value that asks for nothing (the
  value an OpenAI client sends by default); any other value is a 400 ``unsupported_parameter``
  naming the field;
- **no effect**: OpenAI fields that do not change the answer (``user``, ``metadata``): accepted;
- anything else: a 400 ``unknown_parameter`` naming it. Nothing is silently ignored.

docs/api.md lists the same table; a test checks the two agree.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from pensieve.server.errors import APIError

INERT_ONLY: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None, True),
    "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "guided_json": (None,),
    "structured_outputs": (None,), "best_of": (None, 1), "echo": (None, False),
    "suffix": (None, ""), "store": (None, False), "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
    "web_search_options": (None,), "reasoning_effort": (None,), "chat_template": (None,),
}
"""Fields not implemented, with the values that ask for nothing (allowed)."""

NO_EFFECT = frozenset({"user", "metadata"})
"""OpenAI fields that label a request without changing its answer (accepted)."""

CHAT_ONLY_INERT = {"top_logprobs": (None, 0)}
"""/v1/completions asks for alternatives with ``logprobs``; a chat-only field there is inert."""


def _is_inert(value: Any, inert: tuple[Any, ...]) -> bool:
    return any(value == v and type(value) in (type(v), int, float) for v in inert)


def check_fields(body: BaseModel) -> None:
    """400 naming the first field of ``body`` that asks for what the server does not do."""
    extra = body.model_extra or {}
    for name, value in extra.items():
        inert = INERT_ONLY.get(name, CHAT_ONLY_INERT.get(name))
        if inert is not None:
            if not _is_inert(value, inert):
                raise APIError(400, f"{name} is not supported by this server", param=name,
                               code="unsupported_parameter")
        elif name not in NO_EFFECT:
            raise APIError(400, f"unknown field {name!r}: this server does not implement it "
                           "(docs/api.md lists the fields)", param=name,
                           code="unknown_parameter")


def check_message_fields(messages: list[Any]) -> None:
    """400 naming a message field the server would not use (the declared ones are honoured)."""
    for i, m in enumerate(messages):
        for name in (m.model_extra or {}):
            raise APIError(400, f"messages[{i}].{name} is not supported by this server",
                           param=f"messages.{i}.{name}", code="unsupported_parameter")
