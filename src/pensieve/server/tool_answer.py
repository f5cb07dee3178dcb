"""An answer's tool calls, read once per turn in the model's call format."""

from __future__ import annotations

from typing import Any, Protocol

from pensieve.server.chat import ChatRenderer
from pensieve.server.tool_parsers import PARSERS


class _Answer(Protocol):
    output_ids: list[int]
    text: str


class ToolAnswer:
    """Parses a finished answer into (content, OpenAI ``tool_calls``) with the parser of
    ``fmt``; the same call ids every time it is asked (the stored turn and the response)."""

    def __init__(self, fmt: str, renderer: ChatRenderer | None) -> None:
        self.parse = PARSERS[fmt]
        self.fmt = fmt
        self.renderer = renderer
        self._read: tuple[str, list[dict[str, Any]]] | None = None

    def read(self, result: _Answer) -> tuple[str, list[dict[str, Any]]]:
        if self._read is None:
            text = result.text
            if self.fmt != "hermes" and self.renderer is not None:  # markers are special tokens
                text = str(self.renderer.tokenizer.decode(result.output_ids,
                                                          skip_special_tokens=False))
            content, calls = self.parse(text)
            self._read = (content, [c.to_openai() for c in calls]) if calls else (result.text, [])
        return self._read
