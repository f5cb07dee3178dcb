"""An answer's tool calls, read once per turn in the model's call format, and the part of a
streamed answer that can go out before it ends.

Streaming (``hermes``, whose marker is plain text): text streams as content until
``<tool_call>`` appears, holding back only a tail that could be the marker's beginning; from the
marker on, the text is held, and at the end goes out as ``tool_calls`` deltas (or, when it
holds no well-formed call, as content). Formats whose marker is a special token (not in the
streamed text) hold the whole answer to the end."""

from __future__ import annotations

from typing import Any, Protocol

from pensieve.server.chat import ChatRenderer
from pensieve.server.tool_parsers import PARSERS

MARKER = "<tool_call>"


class _Answer(Protocol):
    output_ids: list[int]
    text: str


class ToolAnswer:
    """Parses a finished answer into (content, OpenAI ``tool_calls``) with the parser of
    ``fmt``; the same call ids every time it is asked (the stored turn and the response)."""

    def __init__(self, fmt: str, renderer: ChatRenderer | None, parallel: bool = True) -> None:
        self.parse = PARSERS[fmt]
        self.parallel = parallel
        """False (``parallel_tool_calls: false``): only the answer's first call is returned."""
        self.fmt = fmt
        self.renderer = renderer
        self._read: tuple[str, list[dict[str, Any]]] | None = None
        self.sent = ""
        """Content already streamed."""
        self._held = ""
        self._holding = fmt != "hermes"

    def feed(self, delta: str) -> str:
        """A stream's new text -> the part of it to send as content now."""
        if self._holding:
            return ""
        self._held += delta
        at = self._held.find(MARKER)
        if at >= 0:
            out, self._holding = self._held[:at], True
        else:
            keep = next((k for k in range(min(len(MARKER) - 1, len(self._held)), 0, -1)
                         if self._held.endswith(MARKER[:k])), 0)
            out = self._held[:len(self._held) - keep]
            self._held = self._held[len(out):]
        self.sent += out
        return out

    def last_content(self, result: _Answer) -> str:
        """The content a stream still owes at its end (after :meth:`feed` of every delta)."""
        content, calls = self.read(result)
        if calls:
            return "" if self.sent else content
        return result.text[len(self.sent):]

    def read(self, result: _Answer) -> tuple[str, list[dict[str, Any]]]:
        if self._read is None:
            text = result.text
            if self.fmt != "hermes" and self.renderer is not None:  # markers are special tokens
                text = str(self.renderer.tokenizer.decode(result.output_ids,
                                                          skip_special_tokens=False))
            content, calls = self.parse(text)
            calls = calls if self.parallel else calls[:1]
            self._read = (content, [c.to_openai() for c in calls]) if calls else (result.text, [])
        return self._read
