"""Megatron-style tensor parallelism as a transform of an already built model.

:func:`shard_model` takes a full :class:`~pensieve.models.llama.LlamaForCausalLM` or
:class:`~pensieve.models.opt.OPTForCausalLM` (weights loaded) and turns it, in place, into the
shard of one rank; the model files keep no parallel branches:

* column-parallel (``qkv_proj``, ``gate_up_proj``, ``fc1``): the ``nn.Linear`` keeps only the
  output rows of this rank (its query heads and KV heads, its slice of the MLP), biases sliced
  alike; no communication.
* row-parallel (``o_proj``, ``down_proj``, ``out_proj``, ``fc2``): replaced by
  :class:`RowParallelLinear`, which holds the matching input columns, all-reduces the partial
  products and adds the (full) bias once, after the reduce.
* heads: every ``PagedAttention`` (and the attention module's sizes) gets the local counts.
  ``H / world`` query heads per rank; ``Hkv / world`` KV heads when ``Hkv >= world``, else one
  KV head per rank, replicated: rank ``r`` keeps the KV head its query heads read,
  ``r * Hkv // world``.
* vocab: ``embed_tokens`` becomes a :class:`VocabParallelEmbedding` (rows of this rank's vocab
  slice, padded to ``ceil(V / world)``; tokens outside the slice give zeros, then all-reduce);
  the LM head keeps the same vocab rows (shared when tied) and ``compute_logits`` is wrapped to
  all-gather the logits and cut the padding, so every rank ends with the full ``[N, V]`` logits.
* everything else (norms, rotary, OPT's learned positions and ``project_in/out``) is
  replicated.

Exactness: every output element of a column-parallel layer, every attention head and every
logit is computed from the same numbers as without parallelism; the row-parallel layers sum
``world`` partial products (a different summation order from one matmul, so float results may
differ from a single device in the last bits) and the embedding sums one row with zeros (exact).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pensieve.layers.attention import PagedAttention
from pensieve.models.llama import LlamaForCausalLM
from pensieve.models.opt import OPTForCausalLM

Group = Any  # a torch.distributed ProcessGroup (None: the default group)


# ----------------------------------------------------------------------------- sizes and checks

def local_kv_heads(num_kv_heads: int, world: int) -> int:
    """KV heads each rank holds (one replicated head when there are fewer heads than ranks)."""
    return num_kv_heads // world if num_kv_heads >= world else 1


def _intermediate_size(hf_config: Any) -> int:
    return int(getattr(hf_config, "intermediate_size", 0) or getattr(hf_config, "ffn_dim", 0))


def _family(model: Any) -> str | None:
    if isinstance(model, LlamaForCausalLM):
        return "llama"
    return "opt" if isinstance(model, OPTForCausalLM) else None


def check_shardable(model: Any, world: int) -> None:
    """Raise ValueError if ``model`` cannot be split over ``world`` ranks (before any process
    is started). The vocab needs no divisibility: it is padded."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
    if _family(model) is None:
        raise ValueError(f"tensor parallelism supports Llama/Mistral and OPT, not "
                         f"{type(model).__name__}")
    h, hkv = model.num_heads, model.num_kv_heads
    if h % world:
        raise ValueError(f"tensor_parallel_size {world} does not divide num_attention_heads {h}")
    if hkv >= world and hkv % world:
        raise ValueError(f"tensor_parallel_size {world} does not divide num_key_value_heads "
                         f"{hkv}")
    if hkv < world and world % hkv:
        raise ValueError(f"num_key_value_heads {hkv} < tensor_parallel_size {world} needs the "
                         f"size to be a multiple of the KV heads (to replicate them)")
    inter = _intermediate_size(model.config)
    if inter % world:
        raise ValueError(f"tensor_parallel_size {world} does not divide the MLP size {inter} "
                         f"(intermediate_size / ffn_dim)")


# ----------------------------------------------------------------------------- parallel layers

class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W[:, cols]^T) + b``: the input is this rank's slice of the
    features, the output (and the bias, added once after the reduce) is full width."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Group) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        if self.bias is not None:
            y = y + self.bias
        return y

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        return f"in_features(local)={inp}, out_features={out}, bias={self.bias is not None}"


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + rows)`` of the embedding (``weight`` padded with zero rows to the
    same height on every rank); ids of other ranks read zeros, then the ranks all-reduce."""

    def __init__(self, weight: torch.Tensor, start: int, group: Group) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        out.masked_fill_(~mine[:, None], 0)
        dist.all_reduce(out, group=self.group)
        return out

    def extra_repr(self) -> str:
        return f"rows {self.start}..{self.start + self.weight.shape[0]} (padded), " \
               f"dim={self.weight.shape[1]}"


def _gather_logits(compute_logits: Callable[[torch.Tensor], torch.Tensor], vocab: int,
                   world: int, group: Group, hidden: torch.Tensor) -> torch.Tensor:
    """The model's own ``compute_logits`` on this rank's vocab rows, gathered to ``[N, V]``."""
    local = compute_logits(hidden).contiguous()  # [N, ceil(V / world)]
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts, dim=-1)[:, :vocab]


# ----------------------------------------------------------------------------- the transform

class _Slicer:
    """Index arithmetic of one rank."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def part(self, n: int) -> range:
        """This rank's equal share of ``range(n)``."""
        k = n // self.world
        return range(self.rank * k, (self.rank + 1) * k)

    def heads(self, num_heads: int, num_kv_heads: int) -> tuple[range, range]:
        """Query heads and KV heads of this rank (a KV head may be shared by several ranks)."""
        q = self.part(num_heads)
        if num_kv_heads >= self.world:
            return q, self.part(num_kv_heads)
        kv = self.rank * num_kv_heads // self.world
        return q, range(kv, kv + 1)


def _rows(heads: range, head_dim: int, offset: int = 0) -> list[int]:
    return list(range(offset + heads.start * head_dim, offset + heads.stop * head_dim))


@torch.no_grad()
def _column(linear: nn.Linear, rows: list[int]) -> None:
    """Keep output rows ``rows`` of ``linear`` (in place: the module stays an nn.Linear)."""
    idx = torch.tensor(rows, device=linear.weight.device)
    linear.weight = nn.Parameter(linear.weight.index_select(0, idx), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.index_select(0, idx), requires_grad=False)
    linear.out_features = len(rows)


@torch.no_grad()
def _row(linear: nn.Linear, cols: list[int], group: Group) -> RowParallelLinear:
    idx = torch.tensor(cols, device=linear.weight.device)
    bias = None if linear.bias is None else linear.bias.detach().clone()
    return RowParallelLinear(linear.weight.index_select(1, idx), bias, group)


@torch.no_grad()
def _vocab_rows(weight: torch.Tensor, sl: _Slicer) -> tuple[torch.Tensor, int]:
    """This rank's vocab rows, zero-padded to ``ceil(V / world)``; returns (rows, first id)."""
    vocab = weight.shape[0]
    per = -(-vocab // sl.world)
    start = sl.rank * per
    out = weight.new_zeros((per, weight.shape[1]))
    stop = min(vocab, start + per)
    if stop > start:
        out[: stop - start] = weight[start:stop]
    return out, start


def _shard_attention(attn: Any, sl: _Slicer, o_name: str, group: Group) -> None:
    """Llama / OPT self-attention: fused qkv column-parallel, output projection row-parallel."""
    pa: PagedAttention = attn.attn
    h, hkv, dh = pa.num_heads, pa.num_kv_heads, pa.head_dim
    q_heads, kv_heads = sl.heads(h, hkv)
    rows = (_rows(q_heads, dh) + _rows(kv_heads, dh, h * dh)
            + _rows(kv_heads, dh, (h + hkv) * dh))
    _column(attn.qkv_proj, rows)
    setattr(attn, o_name, _row(getattr(attn, o_name), _rows(q_heads, dh), group))
    pa.num_heads, pa.num_kv_heads = len(q_heads), len(kv_heads)
    attn.num_heads = len(q_heads)
    if hasattr(attn, "num_kv_heads"):  # Llama: sizes its q/k/v split from these
        attn.num_kv_heads = len(kv_heads)
        attn.q_size, attn.kv_size = len(q_heads) * dh, len(kv_heads) * dh


def _shard_vocab(model: Any, embed_owner: Any, sl: _Slicer, group: Group) -> None:
    old = embed_owner.embed_tokens
    tied = getattr(model, "lm_head", None) is not None and model.lm_head.weight is old.weight
    weight, start = _vocab_rows(old.weight, sl)
    embed_owner.embed_tokens = VocabParallelEmbedding(weight, start, group)
    if _family(model) == "llama":
        if tied:
            model.lm_head.weight = embed_owner.embed_tokens.weight
        else:
            model.lm_head.weight = nn.Parameter(_vocab_rows(model.lm_head.weight, sl)[0],
                                                requires_grad=False)
        model.lm_head.out_features = weight.shape[0]
    # OPT's compute_logits reads embed_tokens.weight (tied), now this rank's rows.
    model.compute_logits = functools.partial(  # instance attribute: shadows the method
        _gather_logits, model.compute_logits, model.vocab_size, sl.world, group)


def shard_model(model: Any, rank: int, world: int, group: Group = None) -> Any:
    """Turn a full Llama/OPT model into rank ``rank``'s shard of ``world`` (in place; returns
    it). Collectives run on ``group`` (default: the default process group)."""
    check_shardable(model, world)
    sl = _Slicer(rank, world)
    if _family(model) == "llama":
        for layer in model.model.layers:
            _shard_attention(layer.self_attn, sl, "o_proj", group)
            mlp = layer.mlp
            f = mlp.intermediate_size
            part = list(sl.part(f))
            _column(mlp.gate_up_proj, part + [f + i for i in part])
            mlp.down_proj = _row(mlp.down_proj, part, group)
            mlp.intermediate_size = len(part)
        _shard_vocab(model, model.model, sl, group)
    else:
        decoder = model.model.decoder
        for layer in decoder.layers:
            _shard_attention(layer.self_attn, sl, "out_proj", group)
            part = list(sl.part(layer.fc1.out_features))
            _column(layer.fc1, part)
            layer.fc2 = _row(layer.fc2, part, group)
        _shard_vocab(model, decoder, sl, group)
    q_heads, kv_heads = sl.heads(model.num_heads, model.num_kv_heads)
    model.num_heads, model.num_kv_heads = len(q_heads), len(kv_heads)
    model.tp_rank, model.tp_world = rank, world
    return model


__all__ = ["RowParallelLinear", "VocabParallelEmbedding", "check_shardable", "local_kv_heads",
           "shard_model"]
