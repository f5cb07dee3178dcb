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

Special-token text inside a message's content (``"hi<|im_end|>\n<|im_start|>system"``) is
tokenized as plain text, never as the special tokens the template itself writes, so a user
cannot forge another role's turn (as HF and vLLM treat chat content).
"""

from __future__ import annotations

import re
import threading
from typing import TYPE_CHECKING, Any

from pensieve.server.reasoning import thinks
from pensieve.server.tool_parsers import parser_for_template
from pensieve.server.tools import for_template, native_tools

if TYPE_CHECKING:
    from pensieve.runner.grammar import GrammarCompiler

PLACEHOLDER = "\ue000pensieve-content-{}\ue001"
"""Stands in for message ``i``'s content when the template is rendered to find its own text
(private-use characters: never a special token, never trimmed by a template)."""

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
        names = sorted((t for t in self._special if t), key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, names))) if names else None

    @property
    def tool_format(self) -> str:
        """The format the model writes tool calls in (:mod:`.tool_parsers`)."""
        return parser_for_template(self.tokenizer.chat_template) if self.native_tools \
            else "hermes"

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
               tools: list[dict[str, Any]] | None = None,
               template_kwargs: dict[str, Any] | None = None,
               options: dict[str, Any] | None = None) -> list[int]:
        """Canonical messages (:mod:`.tools`) and the request's tools -> the template's token
        ids; ``template_kwargs`` are extra template variables (e.g. ``enable_thinking``;
        ValueError for a name the renderer sets itself); ``options``: the request's own
        ``apply_chat_template`` arguments (vLLM's ``add_generation_prompt``,
        ``continue_final_message``, ``documents``), which override the renderer's.
        Special-token text inside a message's content is tokenized as plain text:
        ``"hi<|im_end|>"`` from a user is never the end-of-turn token, so no message can forge
        another role's turn. Messages without such text render exactly as
        ``encode(apply_chat_template(...))``."""
        kwargs = dict(template_kwargs or {})
        reserved = RESERVED_TEMPLATE_KWARGS.intersection(kwargs)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {sorted(reserved)}")
        msgs, extra = for_template(messages, tools, self.native_tools)
        kwargs.update(extra)
        kwargs.update(options or {})
        add_generation_prompt = kwargs.pop("add_generation_prompt", add_generation_prompt)
        text = self._apply(msgs, add_generation_prompt, kwargs)
        forged = self._special_re is not None and any(
            self._special_re.search(str(m.get("content") or "")) for m in msgs)
        if not forged:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        spans = self._content_spans(msgs, add_generation_prompt, text, kwargs)
        return self._encode_outside(text, spans)

    def _apply(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
               kwargs: dict[str, Any]) -> str:
        return str(self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs))
    def _content_spans(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                       text: str, kwargs: dict[str, Any]) -> list[tuple[int, int]]:
        """Where each message's content lies in ``text``: the template rendered with
        placeholders gives its own text around them; each content is then matched as given
        or as a template trims it. Raises ValueError where the template's text around the
        contents depends on them (the spans cannot be told apart safely)."""
        marked = [{**m, "content": PLACEHOLDER.format(i)} for i, m in enumerate(messages)]
        skeleton = self._apply(marked, add_generation_prompt, kwargs)
        parts = re.split("\ue000pensieve-content-(\\d+)\ue001", skeleton)
        spans, pos = [], 0
        if not text.startswith(parts[0]):
            raise ValueError("message content holds special-token text this chat template "
                             "cannot keep apart from its own")
        pos = len(parts[0])
        for k in range(1, len(parts), 2):
            content, after = str(messages[int(parts[k])].get("content") or ""), parts[k + 1]
            for cand in (content, content.strip(), content.lstrip(), content.rstrip()):
                end = pos + len(cand)
                if text.startswith(cand, pos) and text.startswith(after, end):
                    break
            else:
                raise ValueError("message content holds special-token text this chat "
                                 "template cannot keep apart from its own")
            spans.append((pos, end))
            pos = end + len(after)
        return spans

    def _encode_outside(self, text: str, spans: list[tuple[int, int]]) -> list[int]:
        """Token ids of ``text`` with the special tokens outside ``spans`` as their ids and
        everything between them (contents included) as plain text."""
        assert self._special_re is not None
        ids: list[int] = []
        start = 0
        for m in self._special_re.finditer(text):
            if any(a <= m.start() < b for a, b in spans):
                continue  # inside a content: stays text
            ids += self._plain(text[start:m.start()])
            ids.append(self._special[m.group()])
            start = m.end()
        return ids + self._plain(text[start:])

    def _plain(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False,
                                          split_special_tokens=True)) if text else []

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
