"""Request bodies of the OpenAI-compatible API (pydantic), with Pensieve's extensions.

The declared fields are the honoured ones; what a body sends beyond them is checked by
:mod:`.fields` (accepted only where it asks for nothing, else a 400 naming it)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pensieve.core.sampling_params import MAX_LOGPROBS

MAX_CHOICES = 16
"""Most choices one request may ask for (``n``): they decode one after another."""
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
"""Bounds of ``repetition_penalty``: HF's penalty divides positive logits by it, so a value
near 0 (1e-40) overflowed them to infinity and the answer became one special token repeated."""
MIN_TEMPERATURE = 0.01
"""A temperature in (0, 0.01) runs as 0.01, as vLLM does: the logits are divided by it, and a
smaller one (1e-40) overflows them to infinity."""
INVALID_UNICODE = "invalid_unicode"
"""The pydantic error type of a string that is not valid Unicode; its ``ctx["field"]`` is the
path of the offending field (``messages.0.content``), which the 400 names as ``param``."""


def _surrogate_path(value: Any, path: str) -> str | None:
    """The path of the first string (key or value) under ``value`` that holds a lone
    surrogate (``"\\ud800"`` in JSON: it cannot be encoded as UTF-8), else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            key = str(k).encode("utf-8", "backslashreplace").decode()  # printable in the 400
            sub = f"{path}.{key}" if path else key
            found = _surrogate_path(k, sub) or _surrogate_path(v, sub)
            if found is not None:
                return found
        return None
    if isinstance(value, list):
        for i, v in enumerate(value):
            found = _surrogate_path(v, f"{path}.{i}" if path else str(i))
            if found is not None:
                return found
    return None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    """Passed to the chat template with the message (templates that read it use it)."""
    tool_calls: list[ToolCallParam] | None = None
    """An assistant message's calls (the history of a tool loop)."""
    tool_call_id: str | None = None
    """A ``tool`` message: the call it answers."""

    def canonical(self) -> dict[str, Any]:
        """The message as the server keeps and renders it (:mod:`.tools`). ValueError: not
        valid text, a message without content, or tool calls outside an assistant message."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        m: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            m["name"] = self.name
        if self.tool_calls:
            if self.role != "assistant":
                raise ValueError("only assistant messages carry tool_calls")
            m["tool_calls"] = [c.canonical() for c in self.tool_calls]
        if self.role == "tool":
            m["tool_call_id"] = self.tool_call_id or ""
        elif self.tool_call_id is not None:
            raise ValueError(f"tool_call_id belongs to tool messages, not to a {self.role} "
                             "message")
        return m

    as_dict = canonical

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            text = self.content
        else:
            parts = []
            for p in self.content:
                if p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise ValueError("only text content parts are supported")
                parts.append(p["text"])
            text = "".join(parts)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate such as "\ud800"
            raise ValueError(f"message content is not valid Unicode text: {e.reason} at "
                             f"position {e.start}") from None
        return text


class ToolFunction(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(BaseModel):
    type: Literal["function"] = "function"
    function: ToolFunction

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class _CallFunction(BaseModel):
    name: str
    arguments: str


class ToolCallParam(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str = ""
    type: Literal["function"] = "function"
    function: _CallFunction

    def canonical(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": self.function.arguments}}


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None
    """``{"name", "schema", "strict"}`` for ``json_schema``."""


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = 0
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    """Choices for the prompt, sharing its KV; the conversation continues with choice 0."""
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(default=1.0, ge=MIN_REPETITION_PENALTY,
                                      le=MAX_REPETITION_PENALTY, allow_inf_nan=False)
    """vLLM: HF's repetition penalty over the prompt and the output (1: off)."""
    min_tokens: int = 0
    """vLLM: end-of-sequence, stop ids and stop strings do not end the answer before this
    many tokens."""
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    """vLLM: drop tokens less likely than ``min_p`` times the most likely one."""
    logit_bias: dict[str, float] | None = None
    """Token id (as a string, OpenAI's form) to a bias in [-100, 100] added to its logit."""
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False
    conversation_id: str | None = None
    """Pensieve: continue this conversation (send only the new messages)."""
    keep_alive_s: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    """Pensieve: the conversation's KV counts as fresh for this long after each turn (finite;
    at most the server's ``--max-keep-alive-s``)."""
    cache_salt: str | None = Field(default=None, max_length=256)
    """vLLM: only requests with the same salt (and, unless the server shares prefixes across
    tenants, of the same tenant) share prefix KV."""
    skip_special_tokens: bool = True
    """vLLM: leave special tokens out of the answer's text (:mod:`.vllm_fields`)."""
    spaces_between_special_tokens: bool = True
    """vLLM: decoding's spaces between special tokens (slow tokenizers only)."""
    include_stop_str_in_output: bool = False
    """vLLM: keep the stop string (or stop token's text) that ended the answer in its text."""
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    """vLLM: feed only the last this many tokens of the context."""
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    """vLLM: the response's id."""
    safety_identifier: str | None = Field(default=None, max_length=256)
    """OpenAI: recorded, not acted on (:mod:`.vllm_fields`)."""
    verbosity: Literal["low", "medium", "high"] | None = None
    """OpenAI: recorded, not acted on."""
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    """OpenAI: recorded, not acted on (a key's requests share prefix KV already)."""
    priority: float = Field(default=0, allow_inf_nan=False)
    """vLLM: scheduling priority, an integer (lower first; :mod:`.priority`)."""
    retention_priority: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    """Pensieve: retention weight of the conversation's KV (default 1; finite, at most the
    server's ``--max-retention-priority``); called ``priority`` before (:mod:`.priority`)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        """A 400 naming the field for any string in the body, at any depth, that is not valid
        Unicode (a lone surrogate), before it can reach the store or the tokenizer."""
        where = _surrogate_path(data, "")
        if where is not None:
            raise PydanticCustomError(INVALID_UNICODE, "{field} is not valid Unicode text "
                                      "(a lone surrogate)", {"field": where})
        return data

    def num_logprobs(self) -> int | None:
        """Alternatives per token asked for (None: no log-probabilities)."""
        return None

    def num_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token asked for (None: no prompt log-probabilities)."""
        return None

    def logit_bias_ids(self) -> dict[int, float]:
        """``logit_bias`` with int keys; ValueError for a key that is not a token id."""
        out: dict[int, float] = {}
        for k, v in (self.logit_bias or {}).items():
            try:
                out[int(k)] = v
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
        return out

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    """Return each answer token's log-probability (``choices[0].logprobs.content``)."""
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    """With ``logprobs``: this many most likely alternatives per token."""
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM: extra variables for the chat template (e.g. Qwen3's ``enable_thinking``)."""
    add_generation_prompt: bool = True
    """vLLM: end the rendering with the template's generation prompt (the assistant's turn)."""
    continue_final_message: bool = False
    """vLLM: render the last (assistant) message open, so the answer continues it."""
    documents: list[dict[str, str]] | None = None
    """vLLM: documents for a retrieval-augmented template (``apply_chat_template``'s)."""
    tools: list[ToolParam] | None = None
    tool_choice: str | dict[str, Any] | None = None
    """``none``, ``auto`` (the default with tools), ``required`` or
    ``{"type": "function", "function": {"name": ...}}`` (:mod:`.tools`)."""
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    """``json_object`` or ``json_schema``: the answer is constrained to it (:mod:`.structured`)."""

    def num_logprobs(self) -> int | None:
        """Raises ValueError for ``top_logprobs`` without ``logprobs: true`` (as vLLM)."""
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise ValueError("top_logprobs needs logprobs: true")
            return None
        return self.top_logprobs or 0


def is_batched(prompt: Any) -> bool:
    """A list of prompts (strings or token-id lists), not one prompt."""
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


def _one_prompt(p: Any, where: str) -> str | list[int]:
    if isinstance(p, str):
        if not p:
            raise ValueError(f"{where} must not be empty")
        return p
    if (isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                          for t in p)):
        return p
    raise ValueError(f"{where} must be a non-empty string or a non-empty list of token ids")


class CompletionRequest(_Sampling):
    prompt: Any
    """A string, a list of token ids, or a batch: a list of strings or of token-id lists."""
    create_conversation: bool = False
    """Pensieve: without ``conversation_id``, start a new conversation whose first turn is this
    prompt; the response carries its id, and later turns send it with only their new tokens.
    (With ``conversation_id`` this is ignored: the named conversation continues.)"""
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    """Return each token's log-probability and this many most likely alternatives."""
    echo: bool = False
    """Return the prompt before the answer; with ``logprobs``, its tokens' log-probabilities
    too (:mod:`.completions_echo`)."""

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v: Any) -> Any:
        """One prompt or a batch of them; else a 400 naming ``prompt``."""
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if is_batched(v):
            if len({isinstance(p, str) for p in v}) > 1:
                raise ValueError("a batched prompt is a list of strings or a list of token-id "
                                 "lists, not both")
            return [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(v)]
        return _one_prompt(v, "prompt")
