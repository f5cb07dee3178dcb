"""``reasoning_content`` apart from ``content``, for models that think in ``<think>`` tags
(Qwen3), as vLLM's Qwen3 reasoning parser splits them.

Whole answer (:func:`split_reasoning`): a leading ``<think>`` is dropped; with a ``</think>``
the text before it is the reasoning and the rest the content; without one it is all content
(e.g. Qwen3 with ``enable_thinking: false``).

Streamed (:class:`ReasoningStream`): an answer that starts with ``<think>`` streams reasoning
until ``</think>``, then content; any other answer streams content. A partial tag at the end
of the text so far is held back until the next text settles it::

    "<thi" -> held;  "<think>Let me" -> reasoning "Let me";  "...</thi" -> "</thi" held;
    "</think>\\n\\nThe answer" -> content "\\n\\nThe answer"

Only a model whose chat template and vocabulary have the tags gets this (:func:`thinks`).
"""

from __future__ import annotations

from typing import Any

THINK_START, THINK_END = "<think>", "</think>"


def thinks(tokenizer: Any) -> bool:
    """True when the chat template uses think tags and the vocabulary has them as tokens."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(str(t) for t in template.values())
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return THINK_END in str(template) and THINK_START in vocab and THINK_END in vocab


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole answer."""
    before, tag, after = text.partition(THINK_START)
    body = after if tag and not before.strip() else text
    if THINK_END not in body:
        return None, text if body is text else body
    reasoning, _, content = body.partition(THINK_END)
    return reasoning, content


def _held(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningStream:
    """Splits streamed answer text into (reasoning delta, content delta)."""

    def __init__(self) -> None:
        self.mode = "start"
        """start (undecided), reasoning or content."""
        self.pending = ""
        """Text held back: a possible start of a tag."""

    def feed(self, delta: str) -> tuple[str, str]:
        text = self.pending + delta
        self.pending = ""
        if self.mode == "start":
            stripped = text.lstrip()
            if stripped.startswith(THINK_START):
                self.mode = "reasoning"
                text = stripped[len(THINK_START):]
            elif THINK_START.startswith(stripped):  # "", "<", "<th", ...: wait
                self.pending = text
                return "", ""
            else:
                self.mode = "content"
        if self.mode == "content":
            return "", text
        i = text.find(THINK_END)
        if i >= 0:
            self.mode = "content"
            return text[:i], text[i + len(THINK_END):]
        k = _held(text, THINK_END)
        self.pending = text[len(text) - k:] if k else ""
        return text[:len(text) - k], ""

    def flush(self) -> tuple[str, str]:
        """The answer ended: what was held back, where it belongs."""
        text, self.pending = self.pending, ""
        return (text, "") if self.mode == "reasoning" else ("", text)
