"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from pensieve.config import DEFAULT_MODEL, EngineConfig, ModelConfig
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.scheduling_config import (
    SchedulerConfig,
    default_max_num_batched_tokens,
    default_prefill_attention_pairs,
    default_step_time_target,
)
from pensieve.engine.llm_engine import LLMEngine, resolve_device
from pensieve.engine.request_output import RequestOutput


def build_engine_config(**kwargs: Any) -> EngineConfig:
    """Flat keyword options (the init fields of the config parts,
    :func:`pensieve.config.owners`) as the composed config
    (:meth:`~pensieve.config.EngineConfig.from_options`: unknown names raise TypeError, None
    leaves the field's default), with the defaults that depend on the device settled first.
    Without a ``max_num_batched_tokens`` (None), chunked prefill takes the device's default
    step budget (:func:`pensieve.core.scheduling_config.default_max_num_batched_tokens`); without a
    ``prefill_attention_pairs``, the device's (:func:`~pensieve.core.scheduling_config.
    default_prefill_attention_pairs`); without a ``step_time_target_s``, the device's
    (:func:`~pensieve.core.scheduling_config.default_step_time_target`)."""
    device = resolve_device(kwargs.get("device") or ModelConfig.device)
    if kwargs.get("max_num_batched_tokens") is None and kwargs.get("enable_chunked_prefill",
                                                                  True) is not False:
        kwargs["max_num_batched_tokens"] = default_max_num_batched_tokens(device.type)
    if kwargs.get("step_time_target_s") is None:
        kwargs["step_time_target_s"] = default_step_time_target(device.type)
    if kwargs.get("prefill_attention_pairs") is None:
        budget = kwargs.get("max_num_batched_tokens") or SchedulerConfig.max_num_batched_tokens
        kwargs["prefill_attention_pairs"] = default_prefill_attention_pairs(device.type, budget)
    return EngineConfig.from_options(**kwargs)


class LLM:
    """Generate from a batch of prompts with continuous batching over a paged KV cache.

    ``model``: an HF checkpoint directory, a ``.gguf`` file, a preset shape (dummy weights),
    ``demo-random``, or by default SmolLM2-135M-Instruct (:mod:`pensieve.models.builtin`).

    >>> llm = LLM(model="path/to/hf_dir", dtype="float32", device="cpu")
    >>> outs = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=16, temperature=0.0))
    >>> outs[0].output_token_ids
    """

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any) -> None:
        self.engine = LLMEngine(build_engine_config(model=model, **kwargs))
        self._tokenizer: Any = None
        self._counter = itertools.count()

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from pensieve.models.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.engine.config.model.model)
        return self._tokenizer

    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        conversation_ids: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (token-id lists or strings); outputs in prompt order.

        With ``conversation_ids``, prompt ``i`` is the *new turn* of conversation
        ``conversation_ids[i]``: its context is every earlier input and output of that
        conversation followed by the prompt, and only what is not cached is computed. A
        conversation may appear once per call; ``None`` makes that prompt a one-off.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise TypeError("prompts must be a list of prompts (each a list of ids or a string)")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        convs = list(conversation_ids) if conversation_ids is not None else [None] * len(prompts)
        if len(convs) != len(prompts):
            raise ValueError(f"{len(convs)} conversation ids for {len(prompts)} prompts")
        named = [c for c in convs if c is not None]
        if len(set(named)) != len(named):
            raise ValueError("a conversation can take only one turn per generate() call")
        order: dict[str, int] = {}
        engine = self.engine
        try:
            for i, (tok, p, cid) in enumerate(zip(ids, params, convs)):
                rid = f"gen-{next(self._counter)}"
                engine.add_request(rid, tok, p, conversation_id=cid)
                order[rid] = i
        except Exception:
            for rid in order:  # leave the engine as it was
                engine.abort_request(rid)
            raise
        results: list[RequestOutput | None] = [None] * len(prompts)
        bar = tqdm(total=len(prompts), desc="generate", disable=not use_tqdm)
        while engine.has_unfinished():
            for out in engine.step():
                results[order[out.request_id]] = out
                bar.update(1)
        bar.close()
        final = [r for r in results if r is not None]
        if any(isinstance(p, str) for p in prompts):
            for r in final:
                r.text = self.tokenizer.decode(r.output_token_ids, skip_special_tokens=True)
        return final

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (``tensor_parallel_size > 1``; also done
        when the LLM is garbage-collected or at exit). Idempotent."""
        self.engine.shutdown()

    def cache_stats(self) -> dict[str, int]:
        """Counters since start: prompt tokens by source (``gpu_hit_tokens``,
        ``cpu_hit_tokens``, ``recomputed_tokens``, ``new_prompt_tokens``), tier moves
        (``swapped_out_tokens``, ``swapped_in_tokens``, ``dropped_tokens``),
        ``suspended_requests``, and blocks per tier."""
        return self.engine.cache_stats()

    def conversation_history(self, conversation_id: str) -> list[int]:
        """Every token of a conversation's completed turns."""
        return self.engine.conversation_history(conversation_id)

    def delete_conversation(self, conversation_id: str) -> None:
        """Free a conversation's KV in both tiers and forget its history."""
        self.engine.delete_conversation(conversation_id)
