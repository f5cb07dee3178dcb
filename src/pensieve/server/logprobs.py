"""Log-probabilities as the OpenAI API and vLLM return them.

The engine gives one :class:`~pensieve.core.outputs.TokenLogprobs` per answer token (None where
its executor computes no logits, e.g. the simulator: then ``logprob`` is null). Chat answers
carry ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``;
completions ``{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}``, whose
``top_logprobs`` holds the sampled token too (as vLLM's). A token's text is the tokenizer's
decoding of it alone (special tokens included), or ``token_id:<id>`` without a tokenizer.
``text_offset`` counts characters of those texts from the answer's start, across a stream's
chunks.
"""

from __future__ import annotations

from typing import Any

from pensieve.core.outputs import TokenLogprobs


class LogprobsFormatter:
    """Formats one answer's log-probabilities, chunk after chunk."""

    def __init__(self, tokenizer: Any, chat: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self.text_offset = 0
        """Characters of the token texts formatted so far (completions' ``text_offset``)."""

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return str(self.tokenizer.decode([token_id]))

    def _entry(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def format(self, tokens: list[int], entries: list[TokenLogprobs | None]) -> dict[str, Any]:
        """The ``logprobs`` object of these consecutive answer tokens."""
        if self.chat:
            content = []
            for t, e in zip(tokens, entries):
                d = self._entry(t, e.logprob if e is not None else None)
                d["top_logprobs"] = [self._entry(a, lp) for a, lp in e.top] if e else []
                content.append(d)
            return {"content": content}
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
        for t, e in zip(tokens, entries):
            text = self.token_text(t)
            out["tokens"].append(text)
            out["token_logprobs"].append(e.logprob if e is not None else None)
            top = {self.token_text(a): lp for a, lp in e.top} if e is not None else {}
            if e is not None:
                top.setdefault(text, e.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.text_offset)
            self.text_offset += len(text)
        return out
