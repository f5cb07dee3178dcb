"""A chat completion's event stream as the Responses API's stream events.

The chat stream (:meth:`.respond.TurnOutput.sse`) gives content deltas, then at its end the
tool calls, the finish reason and the usage. They become, in order::

    response.created, response.in_progress
    [response.output_item.added (message), response.content_part.added,
     response.output_text.delta ..., response.output_text.done,
     response.content_part.done, response.output_item.done]
    [per call: response.output_item.added (function_call),
     response.function_call_arguments.delta, response.function_call_arguments.done,
     response.output_item.done]
    response.completed (or response.incomplete past max_output_tokens)

A chat stream's error event becomes an ``error`` event, then ``response.failed``. The response
is remembered (``remember``) before its last event goes out, so that a client may continue it
the moment it has it. A client that leaves closes the chat stream (which aborts the turn).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any

from pensieve.server.responses_items import (
    ResponsesRequest,
    function_call_item,
    message_item,
    new_id,
    response_object,
)


def _chat_events(raw: str) -> list[dict[str, Any]]:
    """The JSON events of one piece of the chat stream (``[DONE]`` left out)."""
    out = []
    for block in raw.split("\n\n"):
        block = block.strip()
        if block.startswith("data: ") and block != "data: [DONE]":
            out.append(json.loads(block[len("data: "):]))
    return out


class _Translator:
    """Turns chat chunks into Responses events, keeping the output built so far."""

    def __init__(self, body: ResponsesRequest, rid: str, model: str) -> None:
        self.body, self.rid, self.model = body, rid, model
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.text_id: str | None = None
        self.text = ""
        self.reasoning = ""
        self.calls: list[dict[str, Any]] = []
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.extra: dict[str, Any] = {}
        self.error: dict[str, Any] | None = None

    def ev(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def response(self, status: str) -> dict[str, Any]:
        obj = response_object(self.body, self.rid, self.model, status, list(self.output),
                              self.finish, self.usage)
        if self.error is not None:
            obj["error"] = {"code": self.error.get("code") or "server_error",
                            "message": self.error.get("message", "")}
        return {**obj, **self.extra}

    def _text_events(self, delta: str) -> list[dict[str, Any]]:
        out = []
        if self.text_id is None:
            self.text_id = new_id("msg_")
            item = message_item("", "in_progress", self.text_id)
            out.append(self.ev("response.output_item.added", output_index=len(self.output),
                               item=item))
            out.append(self.ev("response.content_part.added", item_id=self.text_id,
                               output_index=len(self.output), content_index=0,
                               part={"type": "output_text", "text": "", "annotations": []}))
        self.text += delta
        out.append(self.ev("response.output_text.delta", item_id=self.text_id,
                           output_index=len(self.output), content_index=0, delta=delta,
                           logprobs=[]))
        return out

    def chunk(self, obj: dict[str, Any]) -> list[dict[str, Any]]:
        if "error" in obj:
            self.error = obj["error"]
            return [self.ev("error", code=self.error.get("code"),
                            message=self.error.get("message"), param=self.error.get("param"))]
        if obj.get("conversation_id"):
            self.extra["conversation_id"] = obj["conversation_id"]
        if "pensieve" in obj:
            self.extra["pensieve"] = obj["pensieve"]
        if obj.get("usage"):
            self.usage = obj["usage"]
        out: list[dict[str, Any]] = []
        for choice in obj.get("choices", []):
            delta = choice.get("delta") or {}
            self.reasoning += delta.get("reasoning_content") or ""
            if delta.get("content"):
                out += self._text_events(delta["content"])
            self.calls += delta.get("tool_calls") or []
            self.finish = choice.get("finish_reason") or self.finish
        return out

    def close_text(self) -> list[dict[str, Any]]:
        if self.text_id is None:
            return []
        i, item = len(self.output), message_item(self.text, item_id=self.text_id)
        part = item["content"][0]
        self.output.append(item)
        return [self.ev("response.output_text.done", item_id=self.text_id, output_index=i,
                        content_index=0, text=self.text, logprobs=[]),
                self.ev("response.content_part.done", item_id=self.text_id, output_index=i,
                        content_index=0, part=part),
                self.ev("response.output_item.done", output_index=i, item=item)]

    def call_events(self) -> list[dict[str, Any]]:
        out = []
        for call in self.calls:
            i, item = len(self.output), function_call_item(call)
            args = item["arguments"]
            out += [self.ev("response.output_item.added", output_index=i,
                            item={**item, "arguments": "", "status": "in_progress"}),
                    self.ev("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=i, delta=args),
                    self.ev("response.function_call_arguments.done", item_id=item["id"],
                            output_index=i, arguments=args, name=item["name"]),
                    self.ev("response.output_item.done", output_index=i, item=item)]
            self.output.append(item)
        return out

    def reasoning_item(self) -> None:
        """A thinking model's reasoning, first in the output (streamed as a whole item, not
        as reasoning deltas)."""
        if self.reasoning:
            self.output.insert(0, {"type": "reasoning", "id": new_id("rs_"), "summary": [],
                                   "content": [{"type": "reasoning_text",
                                                "text": self.reasoning}]})


async def stream_events(body: ResponsesRequest, rid: str, model: str,
                        chat_stream: AsyncIterable[Any],
                        remember: Callable[[dict[str, Any]], Awaitable[None]]
                        ) -> AsyncIterator[dict[str, Any]]:
    """The Responses events of ``chat_stream`` (see the module docstring)."""
    t = _Translator(body, rid, model)
    try:
        yield t.ev("response.created", response=t.response("in_progress"))
        yield t.ev("response.in_progress", response=t.response("in_progress"))
        async for piece in chat_stream:
            text = piece if isinstance(piece, str) else bytes(piece).decode()
            for obj in _chat_events(text):
                for ev in t.chunk(obj):
                    yield ev
        for ev in t.close_text() + t.call_events():
            yield ev
        t.reasoning_item()
        if t.error is not None:
            yield t.ev("response.failed", response=t.response("failed"))
            return
        final = t.response("completed")
        await remember(final)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield t.ev(kind, response=final)
    finally:
        aclose = getattr(chat_stream, "aclose", None)
        if aclose is not None:
            await aclose()
