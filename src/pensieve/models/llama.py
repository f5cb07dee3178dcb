"""Llama (and Mistral-style) decoder over the paged KV cache.

Shapes: ``T`` tokens of the flattened step, ``D`` hidden size, ``H`` / ``Hkv`` query / KV heads,
``Dh`` head dim, ``F`` MLP intermediate size, ``V`` vocab. Parameter names follow HF's except
the fused ``qkv_proj`` (q|k|v rows) and ``gate_up_proj`` (gate|up rows); :meth:`load_weights`
maps HF checkpoint names onto them.

Mistral's ``sliding_window`` is not applied (full causal attention): exact for contexts up to
the window (4096 for Mistral-7B-v0.1), so :func:`pensieve.models.check_max_model_len` refuses a
``max_model_len`` beyond it.

The Qwen families (:mod:`pensieve.models.qwen`) reuse these classes through
:class:`LlamaAttention`'s options (biases on q/k/v only; per-head q/k RMSNorm) and
``LlamaForCausalLM.attention_cls``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pensieve.kernels import rms_norm, rotary, silu_and_mul
from pensieve.layers.attention import AttentionMetadata, PagedAttention
from pensieve.layers.rotary import RotaryEmbedding

_ACTS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu}


class RMSNorm(nn.Module):
    """HF LlamaRMSNorm (normalise in float32, cast back, then scale), after an optional
    residual add: ``norm(x)`` -> out; ``norm(x, residual)`` -> ``(out, x + residual)``. On
    CUDA one fused Triton kernel (:func:`pensieve.kernels.rms_norm`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, residual=None):  # noqa: ANN001, ANN201
        out, residual = rms_norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, residual)


class LlamaAttention(nn.Module):
    """Fused q|k|v projection, rotary, paged attention, output projection. ``qkv_bias`` /
    ``o_bias`` default to ``config.attention_bias``; ``qk_norm`` adds an RMSNorm over each
    head's ``Dh`` channels of q and k before rotary (Qwen3)."""

    def __init__(self, config: Any, qkv_bias: bool | None = None, o_bias: bool | None = None,
                 qk_norm: bool = False) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = bias if qkv_bias is None else qkv_bias
        o_bias = bias if o_bias is None else o_bias
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim**-0.5
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2*Hkv) * Dh]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim))  # [T * H, Dh]
            k = self.k_norm(k.reshape(-1, self.head_dim))  # [T * Hkv, Dh]
        q, k = rotary(  # [T, H, Dh], [T, Hkv, Dh] (on CUDA rotated in place inside qkv)
            q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim),
            cos, sin,
        )
        o = self.attn(q.view(t, -1), k.view(t, -1), v, kv_cache, meta)  # [T, H * Dh]
        return self.o_proj(o)  # [T, D]


class LlamaMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        act = getattr(config, "hidden_act", "silu")
        if act not in _ACTS:
            raise NotImplementedError(f"hidden_act {act!r}")
        self.act = _ACTS[act]
        self.fused_silu = act in ("silu", "swish")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2F]
        if self.fused_silu:
            return self.down_proj(silu_and_mul(gate_up))  # [T, D]
        gate, up = gate_up.chunk(2, dim=-1)  # [T, F] each
        return self.down_proj(self.act(gate) * up)  # [T, D]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, attention_cls: type[LlamaAttention] = LlamaAttention) -> None:
        super().__init__()
        self.self_attn = attention_cls(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, residual, cos, sin, kv_cache, meta):  # noqa: ANN001, ANN201
        """-> ``(mlp_out, residual)``: the layer's output hidden state is their sum, which the
        next layer's (or the final) norm adds in its fused kernel. ``residual`` is None for
        the first layer."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm(h, residual)
        a = self.self_attn(x, cos, sin, kv_cache, meta)  # [T, D]
        x, residual = self.post_attention_layernorm(a, residual)
        return self.mlp(x), residual  # [T, D] each


class LlamaModel(nn.Module):
    def __init__(self, config: Any, attention_cls: type[LlamaAttention] = LlamaAttention) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attention_cls) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids, positions, kv_caches, meta):  # noqa: ANN001, ANN201
        h = self.embed_tokens(input_ids)  # [T, D]
        cos, sin = self.rotary_emb(positions)  # [T, Dh] float32 each
        cos, sin = cos.to(h.dtype), sin.to(h.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, cos, sin, kv_cache, meta)
        return self.norm(h) if residual is None else self.norm(h, residual)[0]  # [T, D]


# HF checkpoint name fragment -> (our fused parameter fragment, shard index)
_STACKED = (
    (".q_proj.", ".qkv_proj.", 0),
    (".k_proj.", ".qkv_proj.", 1),
    (".v_proj.", ".qkv_proj.", 2),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)
_IGNORED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class LlamaForCausalLM(nn.Module):
    """See :class:`pensieve.models.CausalLM` for the interface."""

    attention_cls: type[LlamaAttention] = LlamaAttention
    """The attention block of every layer (a subclass sets a family's options)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.attention_cls)
        attn = self.model.layers[0].self_attn if self.model.layers else self.attention_cls(config)
        self.num_layers = config.num_hidden_layers
        self.num_heads = attn.num_heads
        self.num_kv_heads = attn.num_kv_heads
        self.head_dim = attn.head_dim
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: ``[T]`` int64 -> final-normed hidden states ``[T, D]``."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, D]`` -> ``[N, V]`` float32."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our parameters (with dtype conversion); returns the names
        of the parameters fully filled. Pass every checkpoint tensor in this one call (fused
        parameters count as filled once all their shards arrived)."""
        params = dict(self.named_parameters())
        shards: dict[str, set[int]] = {}
        filled: set[str] = set()
        for name, tensor in weights:
            if any(name.endswith(s) for s in _IGNORED):
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            for hf_frag, our_frag, shard in _STACKED:
                if hf_frag in name:
                    target = name.replace(hf_frag, our_frag)
                    param = _param(params, target, name)
                    rows = param.shape[0] // 2 if our_frag == ".gate_up_proj." else None
                    start, size = self._shard_rows(our_frag, shard, rows)
                    _copy(param.data[start : start + size], tensor, name)
                    shards.setdefault(target, set()).add(shard)
                    if len(shards[target]) == (3 if our_frag == ".qkv_proj." else 2):
                        filled.add(target)
                    break
            else:
                _copy(_param(params, name, name).data, tensor, name)
                filled.add(name)
        return filled

    def _shard_rows(self, frag: str, shard: int, half: int | None) -> tuple[int, int]:
        if half is not None:  # gate | up
            return shard * half, half
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return ((0, q), (q, kv), (q + kv, kv))[shard]


def _param(params: dict[str, nn.Parameter], target: str, hf_name: str) -> nn.Parameter:
    if target not in params:
        raise KeyError(f"checkpoint tensor {hf_name!r} has no matching parameter ({target!r})")
    return params[target]


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)
