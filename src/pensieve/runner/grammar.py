"""Grammar-constrained decoding with xgrammar: compiled grammars, per-request matchers, and
the token bitmask applied to the logits before sampling.

A request whose :class:`~pensieve.core.sampling_params.SamplingParams` carries a
:class:`~pensieve.core.sampling_params.GrammarSpec` gets a matcher here, in the process that
samples (the engine may run in a child process; specs are text and pickle, compiled grammars
are built on each side from the same cache). Per step, for the constrained rows of the batch:

    prepare(requests)   start compiling unseen grammars (thread pool), drop finished matchers
    fill(requests)      each matcher writes its row of the int32 bitmask [N, ceil(V/32)] on
                        the CPU -- after the forward is launched, so it overlaps it on a GPU
    apply(logits)       disallowed tokens of those rows -> -inf (xgrammar's kernel, in place)
    accept(tokens)      each matcher advances with its request's sampled token

Unconstrained rows share the batch and are untouched. A matcher lives until its request is
in ``finished_request_ids`` or its grammar is terminated (it accepted a stop token).

Compiling: :func:`compile_spec` caches compiled grammars by (tokenizer, spec) in an LRU, so
the server's validation compile (in its thread pool, before the request is added) makes the
engine's compile a cache hit when both run in one process.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import xgrammar as xgr

from pensieve.core.outputs import ScheduledRequest
from pensieve.core.sampling_params import GrammarSpec

log = logging.getLogger("pensieve.grammar")

CACHE_SIZE = 256
"""Compiled grammars kept per tokenizer (least recently used dropped first)."""


class GrammarError(ValueError):
    """A grammar xgrammar cannot compile (the message names the problem)."""


class GrammarCompiler:
    """Compiles :class:`GrammarSpec` for one tokenizer and vocabulary size, with an LRU cache
    keyed by the spec (its kind and text). Thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None) -> None:
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return int(self.info.vocab_size)

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec``; :class:`GrammarError` if it cannot compile."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        compiled = self._compile(spec)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        try:
            if spec.kind == "json_object":  # an object, as OpenAI's json_object (the
                # builtin JSON grammar admits any value)
                return self._compiler.compile_json_schema('{"type": "object"}',
                                                          any_whitespace=False)
            if spec.kind == "json_schema":
                json.loads(spec.source)  # a clear error for text that is not JSON
                return self._compiler.compile_json_schema(spec.source, any_whitespace=False)
            return self._compiler.compile_structural_tag(spec.source)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"cannot compile the {spec.kind.replace('_', ' ')}: "
                               f"{_reason(e)}") from None


def _reason(e: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(e).strip()
    if text.startswith("[") and ": " in text:
        text = text.rsplit(".cc:", 1)[-1].split(": ", 1)[-1]
    return text


class GrammarSampling:
    """The matchers of one runner's constrained requests and the step's bitmask.

    ``compiler`` is built on first use (loading the tokenizer costs seconds; most servers
    never see a constrained request)."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pensieve-grammar")
        self._compiling: dict[str, Future[xgr.CompiledGrammar]] = {}
        self.matchers: dict[str, xgr.GrammarMatcher] = {}
        self._bitmask = xgr.allocate_token_bitmask(1, compiler.vocab_size)
        self._rows: list[int] = []
        """Rows of the step's sampled batch that :meth:`fill` constrained."""

    def prepare(self, requests: Sequence[ScheduledRequest], finished: Sequence[str]) -> None:
        """Drop the matchers of ``finished`` requests; start compiling the grammars of
        constrained requests seen for the first time (their prefill steps hide the compile)."""
        for rid in finished:
            self.matchers.pop(rid, None)
            self._compiling.pop(rid, None)
        for s in requests:
            spec = s.sampling_params.grammar
            if (spec is not None and s.request_id not in self.matchers
                    and s.request_id not in self._compiling and s.num_output_tokens == 0):
                self.start(s.request_id, spec)

    def start(self, request_id: str, spec: GrammarSpec) -> None:
        """Compile ``spec`` in the background; the request's matcher starts at its next
        :meth:`fill` (replacing any it had)."""
        self.matchers.pop(request_id, None)
        self._compiling[request_id] = self._pool.submit(self.compiler.compile, spec)

    def _matcher(self, s: ScheduledRequest) -> xgr.GrammarMatcher | None:
        m = self.matchers.get(s.request_id)
        if m is not None:
            return m
        fut = self._compiling.pop(s.request_id, None)
        if fut is None:  # a request already past its first token when first seen: none
            return None
        m = xgr.GrammarMatcher(fut.result())  # compile errors were refused before admission
        self.matchers[s.request_id] = m
        return m

    def fill(self, sampled: Sequence[ScheduledRequest]) -> bool:
        """Write the bitmask rows of the constrained requests among ``sampled`` (the step's
        sampled rows, in order); True when any row is constrained."""
        self._rows = []
        for i, s in enumerate(sampled):
            if s.sampling_params.grammar is None:
                continue
            m = self._matcher(s)
            if m is None or m.is_terminated():
                continue
            if len(self._rows) == 0 and self._bitmask.shape[0] < len(sampled):
                self._bitmask = xgr.allocate_token_bitmask(len(sampled), self.compiler.vocab_size)
            m.fill_next_token_bitmask(self._bitmask, i)
            self._rows.append(i)
        return bool(self._rows)

    def apply(self, logits: torch.Tensor) -> None:
        """Mask, in place, the tokens the grammars disallow in the filled rows. logits:
        ``[N, V']`` with ``V' >= V`` (padding columns past the tokenizer's vocabulary keep
        their values only where the model has them; xgrammar masks them)."""
        if not self._rows:
            return
        n = logits.shape[0]
        mask = self._bitmask[:n].to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.compiler.vocab_size,
                                        indices=self._rows)

    def accept(self, sampled: Sequence[ScheduledRequest], tokens: Sequence[int]) -> None:
        """Advance the matchers of the constrained rows with their sampled tokens."""
        for i in self._rows:
            s = sampled[i]
            m = self.matchers.get(s.request_id)
            if m is None:
                continue
            if not m.accept_token(tokens[i]):
                log.warning("request %s: grammar refused token %d; unconstrained from here",
                            s.request_id, tokens[i])
                del self.matchers[s.request_id]
            elif m.is_terminated():
                del self.matchers[s.request_id]
        self._rows = []
