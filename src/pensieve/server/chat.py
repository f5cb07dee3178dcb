"""Chat templates: messages to token ids, and a new turn as a continuation of a conversation.

A conversation's history in the engine is the exact token sequence it computed: the rendered
context of each turn followed by the tokens the model generated. A new turn appends the tokens
that the chat template adds for the new messages: ``render(prev + new)`` minus
``render(prev)``, taken at the token level. That is exact when the template is prefix-stable
(rendering more messages only appends tokens), which holds for the common templates; when it
does not, :meth:`ChatRenderer.continuation` returns None and the caller starts afresh.
"""

from __future__ import annotations

from typing import Any

DEFAULT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}System: {{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% else %}Assistant: {{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
"""Used when the tokenizer has no chat template of its own."""


class ChatRenderer:
    """Renders messages with the tokenizer's chat template (or a plain default)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        if getattr(tokenizer, "chat_template", None) is None:
            tokenizer.chat_template = DEFAULT_TEMPLATE
        if getattr(tokenizer, "bos_token", None) is None:
            tokenizer.bos_token = ""

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def continuation(
        self, prev: list[dict[str, Any]], new: list[dict[str, Any]]
    ) -> list[int] | None:
        """Token ids the new messages add after ``prev``; None if the template is not
        prefix-stable for them."""
        before = self.render(prev, add_generation_prompt=False)
        after = self.render(prev + new, add_generation_prompt=True)
        if after[: len(before)] != before:
            return None
        return after[len(before):]

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def stop_token_ids(self, stop: list[str]) -> list[int]:
        """Each stop string must be exactly one token (longer ones are not supported)."""
        out = []
        for s in stop:
            ids = self.tokenizer.encode(s, add_special_tokens=False)
            vocab = self.tokenizer.get_vocab()
            if s in vocab:
                out.append(vocab[s])
            elif len(ids) == 1:
                out.append(ids[0])
            else:
                raise ValueError(f"stop string {s!r} is {len(ids)} tokens; only single-token "
                                 "stop strings are supported")
        return out
