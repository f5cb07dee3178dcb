"""OPT decoder over the paged KV cache.

Shapes: ``T`` tokens of the flattened step, ``D`` hidden size, ``E`` word-embedding dim
(``word_embed_proj_dim``; == ``D`` except e.g. OPT-350m), ``H`` heads, ``Dh = D / H``, ``F``
``ffn_dim``, ``V`` vocab. Learned positions: position ``p`` reads row ``p + 2`` of
``embed_positions``. The LM head is always tied to ``embed_tokens`` (as in HF).
Parameter names follow HF's (``model.decoder.*``) except the fused ``qkv_proj`` (q|k|v rows).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pensieve.layers.attention import AttentionMetadata, PagedAttention

_ACTS = {"relu": F.relu, "gelu": F.gelu, "gelu_new": F.gelu, "silu": F.silu}
_POS_OFFSET = 2


class OPTAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = d // self.num_heads
        self.scaling = self.head_dim**-0.5
        bias = bool(getattr(config, "enable_bias", True))
        self.qkv_proj = nn.Linear(d, 3 * d, bias=bias)
        self.out_proj = nn.Linear(d, d, bias=bias)
        # HF scales q before QK^T (fp16-safe for the big OPTs); attention itself uses scale 1.
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_dim, scale=1.0)

    def forward(self, x, kv_cache, meta):  # noqa: ANN001, ANN201
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)  # [T, D] each
        o = self.attn(q * self.scaling, k, v, kv_cache, meta)  # [T, D]
        return self.out_proj(o)


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        d, affine = config.hidden_size, bool(getattr(config, "layer_norm_elementwise_affine", True))
        bias = bool(getattr(config, "enable_bias", True))
        self.pre_norm = bool(config.do_layer_norm_before)
        self.self_attn = OPTAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(d, elementwise_affine=affine)
        self.fc1 = nn.Linear(d, config.ffn_dim, bias=bias)
        self.fc2 = nn.Linear(config.ffn_dim, d, bias=bias)
        self.final_layer_norm = nn.LayerNorm(d, elementwise_affine=affine)
        act = config.activation_function
        if act not in _ACTS:
            raise NotImplementedError(f"activation_function {act!r}")
        self.act = _ACTS[act]

    def forward(self, h, kv_cache, meta):  # noqa: ANN001, ANN201
        # h: [T, D]; pre-norm (most OPTs) or post-norm (OPT-350m).
        x = self.self_attn_layer_norm(h) if self.pre_norm else h
        h = h + self.self_attn(x, kv_cache, meta)
        if not self.pre_norm:
            h = self.self_attn_layer_norm(h)
        x = self.final_layer_norm(h) if self.pre_norm else h
        h = h + self.fc2(self.act(self.fc1(x)))  # [T, F] inside
        if not self.pre_norm:
            h = self.final_layer_norm(h)
        return h


class OPTDecoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        d, e = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = nn.Embedding(config.vocab_size, e)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + _POS_OFFSET, d)
        self.project_in = nn.Linear(e, d, bias=False) if e != d else None
        self.project_out = nn.Linear(d, e, bias=False) if e != d else None
        affine = bool(getattr(config, "layer_norm_elementwise_affine", True))
        keep_final = config.do_layer_norm_before and not getattr(
            config, "_remove_final_layer_norm", False
        )
        self.final_layer_norm = nn.LayerNorm(d, elementwise_affine=affine) if keep_final else None
        self.layers = nn.ModuleList(
            OPTDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )

    def forward(self, input_ids, positions, kv_caches, meta):  # noqa: ANN001, ANN201
        h = self.embed_tokens(input_ids)  # [T, E]
        if self.project_in is not None:
            h = self.project_in(h)  # [T, D]
        h = h + self.embed_positions(positions + _POS_OFFSET)  # [T, D]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h = layer(h, kv_cache, meta)
        if self.final_layer_norm is not None:
            h = self.final_layer_norm(h)
        if self.project_out is not None:
            h = self.project_out(h)  # [T, E]
        return h


class OPTModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config)


_QKV = {".q_proj.": 0, ".k_proj.": 1, ".v_proj.": 2}


class OPTForCausalLM(nn.Module):
    """See :class:`pensieve.models.CausalLM` for the interface."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = OPTModel(config)
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = self.num_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.hidden_size = config.word_embed_proj_dim  # width of forward()'s output
        self.vocab_size = config.vocab_size

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: ``[T]`` int64 -> hidden states ``[T, E]``."""
        return self.model.decoder(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, E]`` -> ``[N, V]`` float32 (tied LM head)."""
        return F.linear(hidden, self.model.decoder.embed_tokens.weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors (``model.decoder.*`` or bare ``decoder.*``) into our parameters;
        returns the names fully filled. Pass every checkpoint tensor in this one call."""
        params = dict(self.named_parameters())
        d = self.config.hidden_size
        shards: dict[str, set[int]] = {}
        filled: set[str] = set()
        for name, tensor in weights:
            if name.startswith("decoder."):
                name = "model." + name
            if name == "lm_head.weight":  # tied to embed_tokens
                continue
            frag = next((f for f in _QKV if f in name), None)
            if frag is not None:
                target = name.replace(frag, ".qkv_proj.")
                if target not in params:
                    raise KeyError(f"checkpoint tensor {name!r} has no parameter {target!r}")
                shard = _QKV[frag]
                _copy(params[target].data[shard * d : (shard + 1) * d], tensor, name)
                shards.setdefault(target, set()).add(shard)
                if len(shards[target]) == 3:
                    filled.add(target)
                continue
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no matching parameter")
            _copy(params[name].data, tensor, name)
            filled.add(name)
        return filled


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)
