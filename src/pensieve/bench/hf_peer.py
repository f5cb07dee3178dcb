"""HF transformers' own continuous batching as a benchmark peer (a stateless server).

:class:`HFContinuousBatchingEngine` drives ``model.init_continuous_batching()`` (a
``transformers.ContinuousBatchingManager``: a background thread that schedules requests into a
paged KV cache and runs the model) through the :class:`~pensieve.bench.engine_api.BenchEngine`
protocol. It is used the way a stateless server is: the engine keeps every conversation's token
history itself and sends *history + new input* as each turn's prompt, so the whole history is
prefilled again on every turn (unless HF's own block-level prefix sharing is switched on with
``prefix_sharing=True``; then matched blocks are counted as GPU hits).

HF API used (present in transformers 5.17 and later):

* ``model.init_continuous_batching(generation_config=GenerationConfig(do_sample=False, ...),
  continuous_batching_config=ContinuousBatchingConfig(...))`` -> manager;
  ``manager.warmup()`` (creates the paged cache; captures CUDA graphs when those are on),
  ``manager.start()``;
* ``manager.add_request(input_ids, request_id=..., max_new_tokens=..., record_timestamps=True,
  eos_token_id=-1)``;
* ``manager.get_result(timeout=...)`` -> ``GenerationOutput`` (``generated_tokens``,
  ``timestamps``, ``lifespan``, ``error``, ``status``);
* ``manager.stop(...)`` / ``manager.destroy()``.

Output length: every turn generates exactly ``params.max_tokens`` tokens. EOS is switched off
by passing ``eos_token_id=-1`` to each request (HF drops negative ids, leaving the request no
stop token; the generation config carries -1 too), so a request only ends when it reaches
``max_new_tokens``. Decoding is always greedy (``do_sample=False`` is one setting for the whole
manager); ``temperature``/``top_k``/``top_p``/``seed``/``stop_token_ids``/``ignore_eos`` of the
:class:`~pensieve.core.sampling_params.SamplingParams` are not used (a warning is logged once).

Times: HF stamps each generated token with ``time.perf_counter()`` when ``record_timestamps``
is on. At ``add_request`` the engine samples ``(clock.now(), perf_counter())`` once and maps HF's
stamps onto ``clock`` with that offset, so ``first_token_time`` is when HF appended the first
output token (after the prefill step that produced it) and ``finish_time`` is when HF marked the
request finished (never later than the ``step()`` that returns it). This needs a clock that runs
at real-time speed (``WallClock``); a virtual clock makes no sense for a real model anyway.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pensieve.bench.engine_api import Clock, WallClock
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.scheduler import ConversationBusyError
from pensieve.core.stats import CacheStats
from pensieve.engine.kv_layout import KVLayout
from pensieve.engine.llm_engine import resolve_device, resolve_dtype
from pensieve.engine.request_output import RequestOutput

log = logging.getLogger("pensieve.bench.hf_peer")

_TORCH_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class _Pending:
    request_id: str
    context: list[int]
    history_len: int
    conversation_id: str | None
    arrival_time: float
    clock_at_add: float
    perf_at_add: float
    max_tokens: int

    def to_clock(self, perf_t: float) -> float:
        """An HF ``perf_counter`` stamp on the engine's clock."""
        return self.clock_at_add + (perf_t - self.perf_at_add)


def _no_init_weights() -> contextlib.AbstractContextManager[Any]:
    """transformers' context that skips weight initialisation (parameters stay ``torch.empty``)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older layouts
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            return contextlib.nullcontext()
    return no_init_weights()


def build_hf_model(model_or_path: Any, dtype: str | torch.dtype = "auto",
                   device: str | torch.device = "auto",
                   attn_implementation: str | None = None, seed: int = 0) -> Any:
    """An HF ``AutoModelForCausalLM`` in eval mode on ``device``.

    ``model_or_path``: a checkpoint directory (loaded with ``from_pretrained``), a pensieve preset
    name (``"llama2-13b-gqa10"``, see :mod:`pensieve.models.presets`), a dict with ``model_type``,
    or an HF ``PretrainedConfig``; the last three get random weights, built directly on the device
    without HF's initialisation and then filled like pensieve's dummy weights (uniform
    +-1e-3, norm weights 1), which takes seconds even for 13B. An already built HF model is
    returned as is (moved to ``device`` only if given explicitly).
    """
    from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

    from pensieve.models.loader import fill_dummy_weights, resolve_config

    if isinstance(model_or_path, PreTrainedModel):
        model = model_or_path
        if str(device) != "auto":
            model = model.to(resolve_device(str(device)))
        return model.eval()
    dev = resolve_device(str(device))
    if isinstance(model_or_path, PretrainedConfig | dict):
        hf_config, path = resolve_config(model_or_path)
    else:
        hf_config, path = resolve_config(os.fspath(model_or_path))
    tdtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, dev, hf_config)
    if tdtype not in _TORCH_DTYPES:
        raise ValueError(f"dtype {tdtype} not supported; use float32, float16 or bfloat16")
    attn_kw = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if path is not None:
        from transformers.utils import is_accelerate_available

        # device_map needs accelerate; without it the weights load on the CPU and are moved
        if dev.type != "cpu" and is_accelerate_available():
            attn_kw["device_map"] = str(dev)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=tdtype, local_files_only=True, **attn_kw)
        return model.to(dev).eval()
    cfg = copy.deepcopy(hf_config)
    if "attn_implementation" not in attn_kw:
        attn_kw["attn_implementation"] = "sdpa"
    with torch.device(dev), _no_init_weights():
        model = AutoModelForCausalLM.from_config(cfg, dtype=tdtype, **attn_kw)
    model.tie_weights()
    model.requires_grad_(False)
    fill_dummy_weights(model, seed=seed)
    return model.eval()


def _cb_config_fields() -> set[str]:
    from transformers import ContinuousBatchingConfig

    return set(inspect.signature(ContinuousBatchingConfig.__init__).parameters) - {"self"}


def kv_layout(hf_config: Any, dtype: torch.dtype, page: int) -> KVLayout:
    """The KV layout of the transformers engine's cache for ``hf_config``: pages of ``page``
    tokens of K and V over all layers, of ``dtype`` (its bytes per page:
    :attr:`KVLayout.block_bytes`)."""
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return KVLayout(int(cfg.num_hidden_layers), kv_heads, head_dim, page, dtype)


def _cb_options(cb_options: dict[str, Any] | None, block_size: int | None,
                prefix_sharing: bool, max_batch_tokens: int | None,
                max_requests_per_batch: int | None, kv_cache_gb: float | None,
                num_blocks: int | None, hf_config: Any, dtype: torch.dtype) -> dict[str, Any]:
    """The ``ContinuousBatchingConfig`` fields of the engine's options (unknown ``cb_options``
    fields are a TypeError; ``kv_cache_gb`` becomes a block count)."""
    from transformers import ContinuousBatchingConfig

    fields = _cb_config_fields()
    opts: dict[str, Any] = dict(cb_options or {})
    unknown = sorted(set(opts) - fields)
    if unknown:
        raise TypeError(f"unknown ContinuousBatchingConfig fields {unknown}; "
                        f"this transformers has {sorted(fields)}")
    size_field = "page_size" if "page_size" in fields else "block_size"
    if block_size is not None:
        opts[size_field] = int(block_size)
    opts.setdefault("allow_block_sharing", bool(prefix_sharing))
    if max_batch_tokens is not None:
        opts["max_batch_tokens"] = int(max_batch_tokens)
    if max_requests_per_batch is not None:
        opts["max_requests_per_batch"] = int(max_requests_per_batch)
    if kv_cache_gb is not None:
        page = int(opts.get(size_field) or getattr(ContinuousBatchingConfig(), size_field)
                   or 256)
        per_block = kv_layout(hf_config, dtype, page).block_bytes
        num_blocks = max(1, int(kv_cache_gb * 2**30 // per_block))
    if num_blocks is not None:
        opts["num_blocks"] = int(num_blocks)
    return opts


class HFContinuousBatchingEngine:
    """HF transformers continuous batching behind the :class:`BenchEngine` protocol.

    Args:
        model_or_path: checkpoint directory, pensieve preset name, dict / ``PretrainedConfig``
            (random weights), or an HF model instance (see :func:`build_hf_model`).
        dtype, device: as for :class:`~pensieve.engine.llm_engine.LLMEngine` (``"auto"``,
            ``"bfloat16"``, ... or a ``torch.dtype``).
        max_batch_tokens: most tokens per forward pass (HF ``max_batch_tokens``); ``None`` lets
            HF size it from free memory.
        num_blocks: KV cache blocks of ``block_size`` tokens (all layers) (HF ``num_blocks``).
        kv_cache_gb: KV cache budget in GiB, turned into ``num_blocks`` (give one of the two;
            with neither, HF sizes the cache from free device memory, ``max_memory_percent``).
        clock: the load generator's clock (real-time speed; see the module docstring).
        attn_implementation: passed to the model; ``None`` loads it with ``"sdpa"`` and lets HF
            switch to flash attention when the ``flash_attn`` package is installed (5.17:
            ``paged|sdpa`` otherwise; 5.24: ``sdpa``). Give e.g. ``"paged|sdpa"`` (5.17) to pin it.
        prefix_sharing: HF ``allow_block_sharing`` (block-level prefix caching). Off by default,
            so every turn recomputes its whole history, like a stateless server without prefix
            cache; on, matched prefix blocks are reported as ``gpu_hit_tokens``.
        block_size: tokens per KV block (HF ``block_size`` in 5.17, ``page_size`` later); ``None``:
            HF's default (256).
        max_requests_per_batch: HF ``max_requests_per_batch`` (``None``: HF default).
        poll_s: how long one :meth:`step` waits for a finished request.
        seed: seed of the random weights (presets / configs).
        cb_options: further ``ContinuousBatchingConfig`` fields (e.g. ``use_cuda_graph``,
            ``use_async_batching``, ``max_memory_percent``, ``default_compile_level``).
    """

    def __init__(self, model_or_path: Any, dtype: str | torch.dtype = "auto",
                 device: str | torch.device = "auto", max_batch_tokens: int | None = None,
                 num_blocks: int | None = None, clock: Clock | None = None, *,
                 kv_cache_gb: float | None = None, attn_implementation: str | None = None,
                 prefix_sharing: bool = False, block_size: int | None = None,
                 max_requests_per_batch: int | None = None, poll_s: float = 0.01,
                 seed: int = 0,
                 cb_options: dict[str, Any] | None = None) -> None:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        if num_blocks is not None and kv_cache_gb is not None:
            raise ValueError("give num_blocks or kv_cache_gb, not both")
        self.clock: Clock = clock if clock is not None else WallClock()
        self.poll_s = float(poll_s)
        self.model = build_hf_model(model_or_path, dtype, device, attn_implementation, seed)
        self.hf_config = self.model.config
        self.vocab_size = int(self.hf_config.get_text_config().vocab_size)
        self.dtype = self.model.dtype
        self.device = self.model.device

        opts = _cb_options(cb_options, block_size, prefix_sharing, max_batch_tokens,
                           max_requests_per_batch, kv_cache_gb, num_blocks, self.hf_config,
                           self.dtype)
        self.prefix_sharing = bool(opts["allow_block_sharing"])
        cb_config = ContinuousBatchingConfig(**opts)
        gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=16,
                                      pad_token_id=self.hf_config.get_text_config().pad_token_id)

        self._pending: dict[str, _Pending] = {}
        self._history: dict[str, list[int]] = {}
        self._busy: set[str] = set()
        self._prefix_hits: dict[str, int] = {}
        self._totals = CacheStats()
        self._counts = {"finished_requests": 0, "prompt_tokens": 0, "output_tokens": 0}
        self._warned_params = False
        self._closed = False

        with torch.no_grad():
            self.manager = self.model.init_continuous_batching(
                generation_config=gen_config, continuous_batching_config=cb_config)
            try:
                self.manager.warmup()  # creates the paged cache (and CUDA graphs, if on)
            except BaseException:
                self._restore_attn()
                raise
            self._hook_prefix_match()
            self.manager.start()
        self.attn_implementation = self.model.config._attn_implementation
        bp = self.manager.batch_processor
        self.num_blocks = getattr(getattr(bp, "cache", None), "num_blocks", None)
        self.max_batch_tokens = getattr(getattr(bp, "cache", None), "max_batch_tokens", None)
        log.info("HF continuous batching on %s (%s): attention %s, num_blocks %s, "
                 "max_batch_tokens %s, prefix sharing %s", self.device, self.dtype,
                 self.attn_implementation, self.num_blocks, self.max_batch_tokens,
                 self.prefix_sharing)
        # The manager's thread is not a daemon: stop it before the interpreter joins threads,
        # so a forgotten shutdown() cannot hang the exit.
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            ref = weakref.ref(self)

            def _stop_at_exit() -> None:
                eng = ref()
                if eng is not None:
                    eng.shutdown()

            with contextlib.suppress(RuntimeError):
                register(_stop_at_exit)

    # ------------------------------------------------------------------ setup helpers
    def _restore_attn(self) -> None:
        orig = getattr(self.manager, "_original_attn_impl", None)
        if orig is not None:
            self.model.set_attn_implementation(orig)
            self.manager._original_attn_impl = None

    def _hook_prefix_match(self) -> None:
        """Record HF's prefix-cache matches per request (HF only searches with prefix sharing)."""
        cache = getattr(self.manager.batch_processor, "cache", None)
        search: Callable[..., int] | None = getattr(cache, "search_prefix_match", None)
        if cache is None or search is None:
            return
        hits = self._prefix_hits

        def search_prefix_match(request_id: str, prompt_ids: list[int]) -> int:
            n = search(request_id, prompt_ids)
            hits[request_id] = max(0, min(int(n), len(prompt_ids) - 1))
            return n

        cache.search_prefix_match = search_prefix_match

    # ------------------------------------------------------------------ BenchEngine
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None,
                    conversation_id: str | None = None) -> None:
        """Queue a turn: the prompt sent to HF is the conversation's history + the new input."""
        if self._closed:
            raise RuntimeError("engine is shut down")
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: empty prompt")
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(f"request {request_id}: token ids out of range "
                             f"[0, {self.vocab_size}): {bad[:5]}")
        if request_id in self._pending:
            raise ValueError(f"request id {request_id!r} already in flight")
        if conversation_id is not None and conversation_id in self._busy:
            raise ConversationBusyError(
                f"conversation {conversation_id!r} has a turn running")
        if not self._warned_params and (params.temperature > 0 or params.stop_token_ids):
            log.warning("HF peer decodes greedily to exactly max_tokens; temperature/top-k/top-p/"
                        "stop tokens of SamplingParams are ignored")
            self._warned_params = True
        history = self._history.get(conversation_id, []) if conversation_id is not None else []
        context = history + list(prompt_token_ids)
        now, perf = self.clock.now(), time.perf_counter()
        rec = _Pending(request_id, context, len(history), conversation_id,
                       now if arrival_time is None else arrival_time, now, perf,
                       params.max_tokens)
        rid = self.manager.add_request(context, request_id=request_id,
                                       max_new_tokens=params.max_tokens,
                                       record_timestamps=True, eos_token_id=-1)
        if rid is None:
            raise RuntimeError(f"HF continuous batching manager refused request {request_id} "
                               f"(running: {self.manager.is_running()})")
        self._pending[request_id] = rec
        if conversation_id is not None:
            self._busy.add(conversation_id)

    def has_unfinished(self) -> bool:
        return bool(self._pending)

    def step(self) -> list[RequestOutput]:
        """Collect requests HF finished: waits up to ``poll_s`` for the first, then takes every
        other one already done."""
        if not self._pending:
            return []
        outs: list[RequestOutput] = []
        res = self.manager.get_result(timeout=self.poll_s)
        while res is not None:
            out = self._convert(res)
            if out is not None:
                outs.append(out)
            res = self.manager.get_result(timeout=0)
        if not outs and self._pending and not self.manager.is_running():
            err = getattr(self.manager.background_thread_status, "fatal_error", None)
            raise RuntimeError(f"HF continuous batching loop stopped with {len(self._pending)} "
                               f"requests unfinished: {err!r}")
        return outs

    def _convert(self, res: Any) -> RequestOutput | None:
        if not res.is_finished():
            return None  # a streamed partial result (not requested)
        rec = self._pending.pop(res.request_id, None)
        if rec is None:
            log.warning("HF result for unknown request %s dropped", res.request_id)
            return None
        if rec.conversation_id is not None:
            self._busy.discard(rec.conversation_id)
        if res.error is not None:
            raise RuntimeError(f"HF continuous batching failed request {rec.request_id}: "
                               f"{res.error}")
        now = self.clock.now()
        out_ids = [int(t) for t in res.generated_tokens]
        stamps = res.timestamps or []
        end = res.lifespan[1] if res.lifespan and res.lifespan[1] > 0 else None
        finish = min(now, rec.to_clock(end)) if end is not None else now
        first = min(finish, rec.to_clock(stamps[0])) if stamps else finish
        stats = self._request_stats(rec, self._prefix_hits.pop(rec.request_id, 0))
        self._totals.add(stats)
        self._counts["finished_requests"] += 1
        self._counts["prompt_tokens"] += len(rec.context)
        self._counts["output_tokens"] += len(out_ids)
        if rec.conversation_id is not None:
            self._history[rec.conversation_id] = rec.context + out_ids
        reason = "length" if len(out_ids) >= rec.max_tokens else "stop"
        return RequestOutput(rec.request_id, rec.context, out_ids, reason,
                             arrival_time=rec.arrival_time, first_token_time=first,
                             finish_time=finish, conversation_id=rec.conversation_id,
                             cache_stats=stats.as_dict())

    @staticmethod
    def _request_stats(rec: _Pending, hit: int) -> CacheStats:
        """Pensieve's accounting: the previous answer's last token never had KV, so it counts as
        new; the rest of the history is recomputed (minus HF prefix-cache hits)."""
        hist_kv = rec.history_len - 1 if rec.history_len else 0
        hit = min(hit, len(rec.context))
        recomputed = max(0, hist_kv - hit)
        return CacheStats(gpu_hit_tokens=hit, recomputed_tokens=recomputed,
                          new_prompt_tokens=len(rec.context) - hit - recomputed)

    def cache_stats(self) -> dict[str, int]:
        """Totals since start: where prompt tokens came from (all recomputed or new unless
        prefix sharing is on), plus request / token counts."""
        out = self._totals.as_dict()
        out.update(self._counts)
        out["running_requests"] = len(self._pending)
        return out

    # ------------------------------------------------------------------ conversations
    def conversation_history(self, conversation_id: str) -> list[int]:
        return list(self._history.get(conversation_id, []))

    def delete_conversation(self, conversation_id: str) -> None:
        self._history.pop(conversation_id, None)

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the manager's thread (failing what is still in flight) and free its cache."""
        if self._closed:
            return
        self._closed = True
        mgr = self.manager
        if mgr.is_running():
            mgr.stop(block=True, timeout=timeout, hard_stop=bool(self._pending))
        with contextlib.suppress(Exception):
            mgr.destroy()
        self._restore_attn()

    def __enter__(self) -> HFContinuousBatchingEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
