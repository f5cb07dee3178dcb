"""Request bodies of the OpenAI-compatible API (pydantic), with Pensieve's extensions."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pensieve.core.sampling_params import MAX_LOGPROBS

DEFAULT_MAX_PRIORITY = 100.0
"""Default bound on a request's ``priority`` (``--max-priority``)."""
DEFAULT_MAX_KEEP_ALIVE_S = 3600.0
"""Default bound on a request's ``keep_alive_s`` (``--max-keep-alive-s``)."""
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
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
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


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = 0
    n: int = Field(default=1, ge=1, le=1)
    seed: int | None = None
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
    priority: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    """Pensieve: retention weight of the conversation's KV (default 1; finite, at most the
    server's ``--max-priority``)."""

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

    def num_logprobs(self) -> int | None:
        """Raises ValueError for ``top_logprobs`` without ``logprobs: true`` (as vLLM)."""
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise ValueError("top_logprobs needs logprobs: true")
            return None
        return self.top_logprobs or 0


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    create_conversation: bool = False
    """Pensieve: without ``conversation_id``, start a new conversation whose first turn is this
    prompt; the response carries its id, and later turns send it with only their new tokens.
    (With ``conversation_id`` this is ignored: the named conversation continues.)"""
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    """Return each token's log-probability and this many most likely alternatives."""

    def num_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: str | list[int]) -> str | list[int]:
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v
