"""vLLM's extra request fields and OpenAI's newer labels, each with its meaning here.

- ``skip_special_tokens`` (default true) and ``spaces_between_special_tokens`` (default
  true): how the answer's text is decoded (the tokenizer's ``decode`` arguments; the second
  changes only slow tokenizers, as in vLLM).
- ``include_stop_str_in_output`` (default false): a stop string that ends the answer stays in
  its text; so does the text of the stop token (end of sequence, ``stop_token_ids``) when
  special tokens are not skipped.
- ``truncate_prompt_tokens: k``: only the last ``k`` tokens of the turn's context are fed
  (left truncation); a continued completions conversation cannot be truncated (a 400).
- ``request_id``: the response's id (``cmpl-<request_id>``, ``chatcmpl-<request_id>``); the
  engine's own request id stays unique.
- ``safety_identifier``, ``verbosity``, ``prompt_cache_key``: accepted, recorded in
  ``pensieve_recorded_fields_total{field}`` and not acted on: no moderation runs here, the
  model's length is not steered, and every request of a key already shares prefix KV on one
  server (``prompt_cache_key`` does not yet route between replicas).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter

from pensieve.server.errors import APIError

RECORDED = ("safety_identifier", "verbosity", "prompt_cache_key")
"""Fields accepted, counted and not acted on."""


class RecordedFields:
    """``pensieve_recorded_fields_total{field}``: requests that carried each field."""

    def __init__(self, registry: Any) -> None:
        self.counter = Counter("pensieve_recorded_fields", "Requests that carried a field "
                               "accepted and recorded without effect (safety_identifier, "
                               "verbosity, prompt_cache_key)", ["field"], registry=registry)

    def record(self, body: Any) -> None:
        for name in RECORDED:
            if getattr(body, name, None) is not None:
                self.counter.labels(name).inc()


def truncated(body: Any, ids: list[int], continues: bool) -> list[int]:
    """``ids`` (a turn's context, or a continued completion's new tokens: ``continues``)
    after ``truncate_prompt_tokens``."""
    k = getattr(body, "truncate_prompt_tokens", None)
    if k is None or len(ids) <= k:
        return ids
    if continues:
        raise APIError(400, "truncate_prompt_tokens cannot cut a continued conversation's "
                       "history: start a new one", param="truncate_prompt_tokens")
    return ids[-k:]


def response_id(body: Any, prefix: str, fresh: str) -> str:
    """The response's id: ``prefix`` and the body's ``request_id``, else ``fresh``."""
    rid = getattr(body, "request_id", None)
    return prefix + rid if rid else fresh


def silent_stop_ids(state: Any, body: Any, tokenizer: Any) -> frozenset[int]:
    """Stop tokens whose text an answer decoded with its special tokens leaves out (all of
    them unless ``include_stop_str_in_output``), as vLLM's detokenizer does."""
    if body.skip_special_tokens or body.include_stop_str_in_output:
        return frozenset()
    eos = getattr(tokenizer, "eos_token_id", None)
    return frozenset([*state.extra_stop_token_ids, *(body.stop_token_ids or ()),
                      *([eos] if isinstance(eos, int) else [])])
