"""LLMEngine: load the model, size the KV cache, and step scheduler + runner.

One step = ``scheduler.schedule()`` -> ``runner.execute()`` -> ``scheduler.update_from_output()``.
The engine owns no policy; it only wires the pieces and converts finished requests to outputs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pensieve.config import EngineConfig
from pensieve.core.eviction import get_policy
from pensieve.core.request import Request
from pensieve.core.sampling_params import SamplingParams
from pensieve.core.scheduler import ConversationBusyError, Scheduler
from pensieve.core.tiered_cache import TieredKVCache
from pensieve.engine.costs import load_cost_model
from pensieve.engine.outputs import RequestOutput
from pensieve.models.loader import load_model, resolve_config
from pensieve.runner.model_runner import ModelRunner, allocate_kv_caches, kv_bytes_per_block

if TYPE_CHECKING:
    from pensieve.parallel.executor import TPExecutor

log = logging.getLogger("pensieve")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
           "half": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available")
    return dev


def resolve_dtype(dtype: str, device: torch.device, hf_config: object) -> torch.dtype:
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(ckpt, str):
            ckpt = _DTYPES.get(ckpt)
        return ckpt if ckpt in (torch.float16, torch.bfloat16) else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of float32, float16, bfloat16, auto")
    return _DTYPES[dtype]


def size_cpu_tier(config: EngineConfig, device: torch.device, block_bytes: int) -> int:
    """CPU-tier blocks of ``block_bytes`` each (per rank under tensor parallelism)."""
    cc = config.cache
    if cc.num_cpu_blocks is not None:
        return cc.num_cpu_blocks
    gb = cc.cpu_kv_gb if cc.cpu_kv_gb is not None else (32.0 if device.type == "cuda" else 1.0)
    return int(gb * 2**30 // block_bytes)


def size_gpu_tier(config: EngineConfig, device: torch.device, hf_config: object,
                  dtype: torch.dtype, block_bytes: int) -> int:
    """GPU-tier blocks of ``block_bytes`` each: the configured count or size, else what fits in
    ``device``'s free memory (call it after the weights are loaded)."""
    cc, sc = config.cache, config.scheduler
    if cc.num_gpu_blocks is not None:
        return cc.num_gpu_blocks
    if cc.gpu_kv_gb is not None:
        return max(1, int(cc.gpu_kv_gb * 2**30 // block_bytes))
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        hidden = int(getattr(hf_config, "hidden_size", 4096))
        inter = int(getattr(hf_config, "intermediate_size", None)
                    or getattr(hf_config, "ffn_dim", 4 * hidden))
        vocab = int(hf_config.vocab_size)  # type: ignore[attr-defined]
        elem = torch.empty((), dtype=dtype).element_size()
        activations = sc.max_num_batched_tokens * (8 * hidden + 3 * inter) * elem
        activations += sc.max_num_seqs * vocab * 4 * 3 + 2**30
        budget = free - (1 - cc.gpu_memory_utilization) * total - activations
        return max(1, int(budget // block_bytes))
    # CPU: enough for every running request to reach max_model_len, at most 2 GiB.
    want = sc.max_num_seqs * -(-sc.max_model_len // cc.chunk_size)
    return max(1, min(want, int(2 * 2**30 // block_bytes)))


class LLMEngine:
    """A model on one device with its paged KV cache and scheduler."""

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        """Source of ``now`` for arrivals, idle times and token timestamps (seconds)."""
        mc, cc = config.model, config.cache
        self.device = resolve_device(mc.device)
        torch.manual_seed(mc.seed)
        hf_config, path = resolve_config(mc.model)
        load_format = mc.load_format
        if path is None and load_format == "auto":
            load_format = "dummy"  # a preset shape has no checkpoint
        policy = get_policy(cc.cache_policy)
        self.runner: ModelRunner | TPExecutor
        if mc.tensor_parallel_size > 1:
            self._init_tensor_parallel(hf_config, path, load_format, policy.uses_cpu_tier)
        else:
            self.model, self.hf_config = load_model(
                path or hf_config, dtype=resolve_dtype(mc.dtype, self.device, hf_config),
                device=self.device, load_format=load_format, seed=mc.seed,
            )
            self.dtype = next(self.model.parameters()).dtype
            m = self.model
            block_bytes = kv_bytes_per_block(m.num_layers, cc.chunk_size, m.num_kv_heads,
                                             m.head_dim, self.dtype)
            num_blocks = self._num_blocks(block_bytes)
            self.kv_caches = allocate_kv_caches(m.num_layers, num_blocks, cc.chunk_size,
                                                m.num_kv_heads, m.head_dim, self.dtype,
                                                self.device)
            num_cpu_blocks = self._num_cpu_blocks(block_bytes) if policy.uses_cpu_tier else 0
            log.info("KV cache: %d GPU-tier blocks (%.2f GiB) on %s, %d CPU-tier blocks "
                     "(%.2f GiB), chunk %d, policy %s", num_blocks,
                     num_blocks * block_bytes / 2**30, self.device, num_cpu_blocks,
                     num_cpu_blocks * block_bytes / 2**30, cc.chunk_size, policy.name)
            self.runner = ModelRunner(self.model, self.kv_caches, cc.chunk_size, num_cpu_blocks)
        self.cost_model = load_cost_model(cc.cost_profile, self.model, self.hf_config,
                                          cc.chunk_size, self.device, self.dtype)
        self._new_cache(policy.name)
        eos = getattr(self.hf_config, "eos_token_id", None)
        self.eos_token_ids: tuple[int, ...] = (
            () if eos is None else tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)
        )
        self.num_steps = 0
        self.last_sampled: dict[str, int] = {}
        """Tokens sampled in the last step, by request id (for streaming)."""
        self.split_range_requests = 0
        """Requests computed as two or more ranges in one step (dropped leading chunks
        recomputed together with the new prompt)."""
        self.audit = False
        """Check the cache's block accounting after every scheduling step (tests)."""

    def _new_cache(self, cache_policy: str) -> None:
        cc = self.config.cache
        policy = get_policy(cache_policy)
        cpu = self.runner.swapper.num_cpu_blocks if policy.uses_cpu_tier else 0
        self.cache = TieredKVCache(self.runner.swapper.num_gpu_blocks, cpu, cc.chunk_size, policy,
                                   self.cost_model.chunk_cost, cc.swap_out_threshold,
                                   cc.decode_reserve)
        self.scheduler = Scheduler(self.config.scheduler, self.cache)

    def reset(self, cache_policy: str | None = None) -> None:
        """Forget every request and conversation and start with empty tiers, optionally under
        another cache policy; the model, the KV tensors and the pinned CPU tier are kept (the
        benchmark runs many points on one engine). The CPU tier keeps the size it was built
        with (none if the engine was built with a policy that has no CPU tier)."""
        if self.scheduler.has_unfinished():
            for rid in list(self.scheduler.requests):
                self.scheduler.abort_request(rid, self.clock())
        self._new_cache(cache_policy or self.cache.policy.name)
        self.split_range_requests = 0
        self.num_steps = 0

    def _init_tensor_parallel(self, hf_config: object, path: str | None, load_format: str,
                              uses_cpu_tier: bool) -> None:
        """``tensor_parallel_size > 1``: worker processes hold the model shards and each rank's
        slice of both KV tiers (``pensieve.parallel``); this process keeps the scheduler and a
        weightless (meta-device) model for its shapes."""
        from pensieve.parallel.executor import TPExecutor

        self.hf_config = hf_config
        self.dtype = resolve_dtype(self.config.model.dtype, self.device, hf_config)
        self.runner = TPExecutor(self.config, path or hf_config, hf_config, self.dtype,
                                 load_format, self.device, uses_cpu_tier)
        self.model = self.runner.model
        self.kv_caches = []

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (idempotent; a no-op otherwise)."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    def _num_cpu_blocks(self, block_bytes: int) -> int:
        return size_cpu_tier(self.config, self.device, block_bytes)

    def _num_blocks(self, block_bytes: int) -> int:
        return size_gpu_tier(self.config, self.device, self.hf_config, self.dtype, block_bytes)

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None,
                    conversation_id: str | None = None) -> None:
        """Queue a request. With a ``conversation_id`` the prompt is the *new* turn's input: the
        context is the conversation's history followed by it."""
        vocab = int(self.hf_config.vocab_size)
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: empty prompt")
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(
                f"request {request_id}: token ids out of range [0, {vocab}): {bad[:5]}")
        context = list(prompt_token_ids)
        if conversation_id is not None:
            conv = self.cache.conversations.get(conversation_id)
            if conv is not None:
                context = conv.token_ids + context
        req = Request(request_id, context, params,
                      arrival_time=self.clock() if arrival_time is None else arrival_time,
                      eos_token_ids=self.eos_token_ids, conversation_id=conversation_id)
        self.scheduler.add_request(req)

    def conversation_history(self, conversation_id: str) -> list[int]:
        """Every token of the conversation's completed turns (empty if unknown)."""
        conv = self.cache.conversations.get(conversation_id)
        return list(conv.token_ids) if conv is not None else []

    def delete_conversation(self, conversation_id: str) -> None:
        """Free the conversation's KV in both tiers and forget its history (no-op if unknown)."""
        self.cache.delete(conversation_id)

    def restore_conversation(self, conversation_id: str, token_ids: list[int]) -> None:
        """Give a conversation its history without KV (after a restart: recomputed on use)."""
        conv = self.cache.conversation(conversation_id)
        if conv.running or conversation_id in self.scheduler.busy_conversations:
            raise ConversationBusyError(f"conversation {conversation_id!r} has a turn running")
        if not conv.token_ids:
            conv.token_ids = list(token_ids)

    def set_conversation_hints(self, conversation_id: str, priority: float | None = None,
                               keep_alive_s: float | None = None) -> None:
        """Retention hints: a higher priority or a keep-alive window keeps its KV longer."""
        conv = self.cache.conversation(conversation_id)
        if priority is not None:
            if not priority > 0:
                raise ValueError(f"priority must be > 0, got {priority}")
            conv.priority = float(priority)
        if keep_alive_s is not None:
            if keep_alive_s < 0:
                raise ValueError(f"keep_alive_s must be >= 0, got {keep_alive_s}")
            conv.keep_alive_s = float(keep_alive_s)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def cache_stats(self) -> dict[str, int]:
        """Totals since start: token sources, swaps, drops, suspensions, blocks in use."""
        out = self.cache.stats.as_dict()
        out["split_range_requests"] = self.split_range_requests
        out["swap_in_bytes"] = self.runner.swapper.bytes_in
        out["swap_out_bytes"] = self.runner.swapper.bytes_out
        out["gpu_blocks_total"] = self.cache.gpu.num_blocks
        out["gpu_blocks_free"] = self.cache.gpu.num_free_blocks
        cpu = self.cache.cpu
        out["cpu_blocks_total"] = cpu.num_blocks if cpu is not None else 0
        out["cpu_blocks_free"] = cpu.num_free_blocks if cpu is not None else 0
        return out

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id, self.clock())

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the requests that finished in it."""
        self.last_sampled = {}
        sched = self.scheduler.schedule(self.clock())
        if sched.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress: KV cache too small for a request")
            return []
        if self.audit:
            self.cache.check_integrity()
        self.split_range_requests += sum(len(s.ranges) > 1 for s in sched.requests)
        result = self.runner.execute(sched)
        self.last_sampled = result.sampled_token_ids
        finished = self.scheduler.update_from_output(sched, result, self.clock())
        if self.audit:
            self.cache.check_integrity()
        self.num_steps += 1
        return [
            RequestOutput(r.request_id, r.prompt_token_ids, r.output_token_ids,
                          r.finish_reason, arrival_time=r.arrival_time,
                          first_token_time=r.first_token_time, finish_time=r.finish_time,
                          conversation_id=r.conversation_id,
                          cache_stats=r.cache_stats.as_dict())
            for r in finished
        ]
