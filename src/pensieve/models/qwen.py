"""Qwen2 / Qwen2.5 and Qwen3 decoders: the Llama decoder of :mod:`pensieve.models.llama` with
each family's attention options.

* Qwen2 (and Qwen2.5, same architecture): biases on the q, k and v projections (not on
  ``o_proj``).
* Qwen3: an RMSNorm over each head's ``Dh`` channels of q and of k (``q_norm`` / ``k_norm``,
  weights ``[Dh]`` shared by the heads) before rotary; biases only with ``attention_bias``;
  ``head_dim`` set in the config (not ``hidden_size / heads``).

Parameter and checkpoint names are Llama's (``q_norm`` / ``k_norm`` as in HF). Sliding-window
attention (``use_sliding_window``) is not implemented: :func:`pensieve.models.check_max_model_len`
refuses a ``max_model_len`` beyond the window when a checkpoint turns it on.
"""

from __future__ import annotations

from typing import Any

from pensieve.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    def __init__(self, config: Any) -> None:
        super().__init__(config, qkv_bias=True, o_bias=False)


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: Any) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, qkv_bias=bias, o_bias=bias, qk_norm=True)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5; see :class:`pensieve.models.CausalLM` for the interface."""

    attention_cls = Qwen2Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense); see :class:`pensieve.models.CausalLM` for the interface."""

    attention_cls = Qwen3Attention
