"""Chat templates: messages to token ids.

A conversation's history in the engine is the exact token sequence it computed. A new turn
renders *all* its messages with the chat template (and the generation prompt); the engine
keeps the history up to its first token that differs from that rendering and computes the
rest (:meth:`AsyncEngine.generate` with ``full_context``). So the model always sees exactly
``apply_chat_template(messages, add_generation_prompt=True)``: where the template is
prefix-stable only the new tokens are computed (plus the end-of-turn text after an answer the
model did not end itself, e.g. one cut at ``max_tokens``); where it is not (a template that
strips or rewrites earlier messages, an answer whose text re-tokenizes differently), the tokens
from the first difference on are recomputed.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from pensieve.server.tool_parsers import parser_for_template
from pensieve.server.tools import for_template, native_tools

if TYPE_CHECKING:
    from pensieve.runner.grammar import GrammarCompiler

from pensieve.server.reasoning import thinks

DEFAULT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}System: {{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% else %}Assistant: {{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
"""Used when the tokenizer has no chat template of its own."""


RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tokenize", "add_generation_prompt", "continue_final_message",
    "chat_template", "tools", "documents", "return_dict", "return_tensors", "padding",
    "truncation", "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs"})
"""Arguments of ``apply_chat_template`` that ``chat_template_kwargs`` may not set."""


class ChatRenderer:
    """Renders messages with the tokenizer's chat template (or ``chat_template``, or a plain
    default when the tokenizer has none)."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        elif getattr(tokenizer, "chat_template", None) is None:
            tokenizer.chat_template = DEFAULT_TEMPLATE
        if getattr(tokenizer, "bos_token", None) is None:
            tokenizer.bos_token = ""
        self.thinks = thinks(tokenizer)
        """The model thinks in ``<think>`` tags: answers get ``reasoning_content``."""
        self._special = {t: i for t, i in zip(tokenizer.all_special_tokens,
                                              tokenizer.all_special_ids, strict=False)}
        self._special.update({t.content: i for i, t in
                              getattr(tokenizer, "added_tokens_decoder", {}).items()})
        self.native_tools = native_tools(tokenizer.chat_template)
        """The template renders ``tools`` itself (else: :mod:`.tools`' fallback)."""
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    @property
    def tool_format(self) -> str:
        """The format the model writes tool calls in (:mod:`.tool_parsers`)."""
        return parser_for_template(self.tokenizer.chat_template) if self.native_tools \
            else "hermes"

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
               tools: list[dict[str, Any]] | None = None,
               template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Canonical messages (:mod:`.tools`) and the request's tools -> token ids;
        ``template_kwargs`` are extra template variables (e.g. ``enable_thinking``; ValueError
        for a name the renderer sets itself)."""
        kwargs = dict(template_kwargs or {})
        reserved = RESERVED_TEMPLATE_KWARGS.intersection(kwargs)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {sorted(reserved)}")
        msgs, extra = for_template(messages, tools, self.native_tools)
        text = self.tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
            **{**kwargs, **extra})
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles (and caches) the grammars of this tokenizer, built on first use."""
        with self._lock:
            if self._compiler is None:
                from pensieve.runner.grammar import GrammarCompiler

                self._compiler = GrammarCompiler(self.tokenizer)
            return self._compiler

    def encode(self, text: str) -> list[int]:
        """A completion prompt's tokens (with the tokenizer's own special tokens, e.g. BOS)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"the prompt is not valid Unicode text: {e.reason}") from None
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def special_token_id(self, text: str) -> int | None:
        """The id of a special token spelled ``text`` (e.g. ``<|im_end|>``), else None: such a
        stop string never shows in decoded text, so it stops on the token instead."""
        return self._special.get(text)
