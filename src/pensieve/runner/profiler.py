"""Offline profiling of the chunk recompute cost on the actual model and device.

:func:`profile_cost` times the model's full forward (``model(input_ids, positions, kv_caches,
meta)``, the real paged attention path: Triton kernels on CUDA, the torch references on the
CPU) for requests that each compute ONE chunk of ``chunk_size`` query tokens at positions
``[l, l + chunk_size)`` over a block table covering ``l + chunk_size`` positions, at a few
context lengths ``l``. The KV cache holds random values (never zeros), scattered over shuffled
blocks as a paged cache would be.

How the measurement maps onto :class:`~pensieve.core.cost_model.CostModel`
(``Cost(l) = attention(l) + c``): ``c`` (``other_s``) is the time per chunk measured at the
smallest profiled context (``l = 0`` by default), and ``attention_s[i]`` is the measured time at
``context_lens[i]`` minus ``c`` (clamped at 0, and made non-decreasing unless
``monotone=False``, so timing noise cannot make a longer context look cheaper). So
``attention_s[0] == 0`` and ``chunk_cost(l_i)`` equals the measured time at every sample (up to
that clamping; the raw times are kept in ``measured_s``): the attention over the chunk's own
tokens, like the non-attention work, is inside ``c``.

With ``chunks_per_batch = 1`` (the default) the forward of a single 32-token chunk is dominated
by reading the weights, a cost that a chunk recomputed inside a larger batch shares with the
rest of the batch. ``chunks_per_batch = B`` runs ``B`` such requests (each its own context
blocks) in one forward and divides by ``B``: the marginal per-chunk cost in a batch.

CUDA timing: CUDA events around each forward, after warm-up; the median of ``iters``. On the CPU
(tiny models, tests): ``time.perf_counter``.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pensieve.core.cost_model import DEFAULT_CONTEXT_LENS, CostModel, profile_key
from pensieve.layers.attention import AttentionMetadata

_DTYPE_BYTES = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4}


# ------------------------------------------------------------------------------- model shape


def config_shape(hf_config: Any) -> dict[str, Any]:
    """Shape fields of an HF config (Llama / Mistral / OPT): ``model_type``, ``num_layers``,
    ``hidden_size``, ``num_heads``, ``num_kv_heads``, ``head_dim``, ``intermediate_size``,
    ``gated_mlp``."""
    model_type = str(getattr(hf_config, "model_type", None) or "model")
    num_heads = int(hf_config.num_attention_heads)
    hidden = int(hf_config.hidden_size)
    inter = getattr(hf_config, "intermediate_size", None) or getattr(hf_config, "ffn_dim", None)
    if inter is None:
        raise ValueError(f"{model_type} config has neither intermediate_size nor ffn_dim")
    return {
        "model_type": model_type,
        "num_layers": int(hf_config.num_hidden_layers),
        "hidden_size": hidden,
        "num_heads": num_heads,
        "num_kv_heads": int(getattr(hf_config, "num_key_value_heads", None) or num_heads),
        "head_dim": int(getattr(hf_config, "head_dim", None) or hidden // num_heads),
        "intermediate_size": int(inter),
        "gated_mlp": model_type != "opt",
    }


def device_name(device: torch.device | str) -> str:
    """``torch.cuda.get_device_name`` for CUDA devices (e.g. ``"NVIDIA H200"``), else the
    device type (``"cpu"``)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def config_profile_key(hf_config: Any, device: torch.device | str) -> str:
    """:func:`~pensieve.core.cost_model.profile_key` of an HF config on ``device`` (a device or
    a device name such as ``"NVIDIA H200"``)."""
    s = config_shape(hf_config)
    if isinstance(device, str) and not _is_device_spec(device):
        name = device  # already a device name
    else:
        name = device_name(device)
    return profile_key(
        s["model_type"], s["num_layers"], s["hidden_size"], s["num_heads"], s["num_kv_heads"],
        s["head_dim"], s["intermediate_size"], name,
    )


def analytic_cost_model(
    hf_config: Any,
    chunk_size: int = 32,
    dtype: torch.dtype = torch.bfloat16,
    context_lens: Sequence[int] = DEFAULT_CONTEXT_LENS,
    **rates: float,
) -> CostModel:
    """:meth:`CostModel.analytic` for an HF config (``rates``: ``flops_per_s``,
    ``bytes_per_s``)."""
    s = config_shape(hf_config)
    return CostModel.analytic(
        s["num_layers"], s["hidden_size"], s["num_heads"], s["num_kv_heads"], s["head_dim"],
        s["intermediate_size"], chunk_size=chunk_size, dtype_bytes=_DTYPE_BYTES.get(dtype, 2),
        gated_mlp=s["gated_mlp"], context_lens=context_lens,
        model_key=config_profile_key(hf_config, "analytic"), **rates,
    )


def load_cost_model(
    profile_dir: str | None,
    hf_config: Any,
    device: torch.device | str,
    chunk_size: int = 32,
    dtype: torch.dtype = torch.bfloat16,
) -> CostModel:
    """The profile ``<profile_dir>/<config_profile_key>.json`` if it exists and was taken with
    ``chunk_size``, else the analytic estimate."""
    if profile_dir:
        path = os.path.join(profile_dir, config_profile_key(hf_config, device) + ".json")
        if os.path.isfile(path):
            model = CostModel.load(path)
            if model.chunk_size == chunk_size:
                return model
    return analytic_cost_model(hf_config, chunk_size, dtype)


def _is_device_spec(s: str) -> bool:
    try:
        torch.device(s)
    except (RuntimeError, ValueError):
        return False
    return True


# ------------------------------------------------------------------------------- profiling


def _position_limit(model: nn.Module) -> int | None:
    """Number of learned positions (OPT's ``embed_positions``), None for RoPE models.

    Positions only select embedding rows (or rotary angles), which costs the same whatever the
    value; the context length the attention reads is set by the metadata. So for models with a
    learned table the profiler feeds ``positions % limit`` and can still time long contexts.
    """
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    for name, _ in model.named_modules():
        if name.endswith("embed_positions") and limit is not None:
            return int(limit)
    return None


def _model_dtype_device(model: nn.Module) -> tuple[torch.dtype, torch.device]:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype, p.device
    raise ValueError("model has no floating-point parameters")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_settings(lens: list[int], context_lens: Sequence[int], chunk_size: int,
                    chunks_per_batch: int, iters: int, warmup: int) -> None:
    if not lens:
        raise ValueError("context_lens is empty")
    if lens[0] < 0 or len(set(lens)) != len(lens):
        raise ValueError(f"context_lens must be distinct and >= 0, got {list(context_lens)}")
    if chunk_size < 1 or chunks_per_batch < 1 or iters < 1 or warmup < 0:
        raise ValueError(f"bad settings: {chunk_size=} {chunks_per_batch=} {iters=} {warmup=}")


def _attention_times(measured: list[float], monotone: bool) -> list[float]:
    """Attention time per context length: the measured time minus that at the first length
    (the rest of the step), made non-decreasing if ``monotone``."""
    attention = [max(0.0, t - measured[0]) for t in measured]
    if monotone:
        for i in range(1, len(attention)):
            attention[i] = max(attention[i], attention[i - 1])
    return attention


def _profile_caches(kv_caches: list[torch.Tensor] | None, num_layers: int, num_blocks: int,
                    block_shape: tuple[int, int, int], dtype: torch.dtype, dev: torch.device,
                    seed: int) -> tuple[list[torch.Tensor], bool]:
    """The caches to time against, filled with random values (never zeros: an all-zero cache
    is not typical), and whether the profiler allocated them (``kv_caches`` None)."""
    if kv_caches is None:
        shape = (2, num_blocks, *block_shape)
        kv_caches = [torch.empty(shape, dtype=dtype, device=dev) for _ in range(num_layers)]
        own = True
    else:
        own = False
        if len(kv_caches) != num_layers:
            raise ValueError(f"got {len(kv_caches)} KV caches for {num_layers} layers")
        have = kv_caches[0].shape
        if have[1] < num_blocks or tuple(have[2:]) != block_shape:
            raise ValueError(
                f"kv_caches {tuple(have)} too small or mis-shaped: need [2, >= {num_blocks}, "
                f"{', '.join(map(str, block_shape))}]"
            )
    dev_gen = torch.Generator(device=dev)
    dev_gen.manual_seed(seed)
    for cache in kv_caches:
        cache.normal_(0.0, 1.0, generator=dev_gen)
    return kv_caches, own


def _chunk_step(model: nn.Module, kv_caches: list[torch.Tensor], tables: torch.Tensor, ctx: int,
                c: int, b: int, pos_limit: int | None, vocab: int, gen: torch.Generator,
                dev: torch.device) -> Any:
    """One forward of ``b`` chunks of ``c`` tokens at context ``ctx`` (a closure to time)."""
    nb = math.ceil((ctx + c) / c)
    table = tables[:, :nb].contiguous()
    pos = torch.arange(ctx, ctx + c, dtype=torch.int64)
    slots = (table[:, pos // c].long() * c + (pos % c)).reshape(-1)  # [b * c]
    positions = pos.repeat(b)
    if pos_limit is not None:
        positions = positions % pos_limit
    meta = AttentionMetadata(
        slot_mapping=slots.to(dev),
        query_start_loc=torch.arange(0, (b + 1) * c, c, dtype=torch.int32).to(dev),
        range_start_pos=torch.full((b,), ctx, dtype=torch.int32).to(dev),
        range_table=torch.arange(b, dtype=torch.int32).to(dev),
        block_tables=table.to(dev),
        max_query_len=c,
    )
    input_ids = torch.randint(0, vocab, (b * c,), generator=gen, dtype=torch.int64).to(dev)
    positions = positions.to(dev)

    def step() -> None:
        model(input_ids, positions, kv_caches, meta)

    return step


@torch.inference_mode()
def profile_cost(
    model: nn.Module,
    chunk_size: int = 32,
    context_lens: Sequence[int] = DEFAULT_CONTEXT_LENS,
    device: torch.device | str | None = None,
    *,
    kv_caches: list[torch.Tensor] | None = None,
    chunks_per_batch: int = 1,
    warmup: int = 3,
    iters: int = 10,
    monotone: bool = True,
    model_key: str | None = None,
    seed: int = 0,
) -> CostModel:
    """Measure ``Cost(l)`` of one chunk on ``model`` at each of ``context_lens`` (see the module
    docstring for what is timed and how it maps onto the CostModel).

    ``model`` implements :class:`pensieve.models.CausalLM` (``num_layers``, ``num_kv_heads``,
    ``head_dim``, ``vocab_size``). ``device`` defaults to the model's. ``kv_caches``: optional
    caches to time against (one ``[2, num_blocks, chunk_size, num_kv_heads, head_dim]`` tensor
    per layer); they are overwritten with random values, so they must hold no live state; by
    default the profiler allocates its own, just big enough, and frees them at the end.
    ``model_key`` defaults to :func:`config_profile_key` of ``model.config`` (if any).
    """
    lens = sorted(int(x) for x in context_lens)
    _check_settings(lens, context_lens, chunk_size, chunks_per_batch, iters, warmup)
    dtype, model_device = _model_dtype_device(model)
    dev = torch.device(device) if device is not None else model_device
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    lm: Any = model  # a CausalLM
    num_layers, num_kv_heads = int(lm.num_layers), int(lm.num_kv_heads)
    head_dim, vocab = int(lm.head_dim), int(lm.vocab_size)
    c, b = chunk_size, chunks_per_batch
    blocks_per_req = math.ceil((lens[-1] + c) / c)
    num_blocks = b * blocks_per_req
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    kv_caches, own = _profile_caches(kv_caches, num_layers, num_blocks,
                                     (c, num_kv_heads, head_dim), dtype, dev, seed)

    # Each request owns blocks_per_req shuffled blocks; it uses a prefix of its table.
    perm = torch.randperm(kv_caches[0].shape[1], generator=gen)[:num_blocks]
    tables = perm.view(b, blocks_per_req).to(torch.int32)
    pos_limit = _position_limit(model)
    timer = _CudaTimer(dev) if dev.type == "cuda" else _CpuTimer()

    measured: list[float] = []
    for ctx in lens:
        step = _chunk_step(model, kv_caches, tables, ctx, c, b, pos_limit, vocab, gen, dev)
        for _ in range(warmup):
            step()
        _sync(dev)
        times = [timer.time(step) for _ in range(iters)]
        measured.append(statistics.median(times) / b)

    if own:
        del kv_caches
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    other = measured[0]
    attention = _attention_times(measured, monotone)
    if model_key is None:
        config = getattr(model, "config", None)
        model_key = config_profile_key(config, dev) if config is not None else ""
    return CostModel(
        chunk_size=c,
        context_lens=tuple(lens),
        attention_s=tuple(attention),
        other_s=other,
        model_key=model_key,
        device=device_name(dev),
        dtype=str(dtype).removeprefix("torch."),
        source="profile",
        measured_s=tuple(measured),
    )


class _CpuTimer:
    def time(self, fn: Any) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


class _CudaTimer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def time(self, fn: Any) -> float:
        stream = torch.cuda.current_stream(self.device)
        self.start.record(stream)
        fn()
        self.end.record(stream)
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


__all__ = [
    "analytic_cost_model", "config_profile_key", "config_shape", "device_name",
    "load_cost_model", "profile_cost",
]
