"""Named model shapes as HF config objects, for dummy-weight benchmarks without any files.

``make_dummy_config("llama2-13b-gqa10")`` -> a ``transformers.LlamaConfig``; pass it (or just the
name) to :func:`pensieve.models.loader.load_model` with ``load_format="dummy"``.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import LlamaConfig, OPTConfig, PretrainedConfig, Qwen2Config, Qwen3Config


def _llama(hidden: int, layers: int, heads: int, kv_heads: int, inter: int, **kw) -> LlamaConfig:
    base = dict(
        vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5, hidden_act="silu",
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    base.update(kw)
    cfg = LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=inter, **base,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def _opt(hidden: int, layers: int, heads: int, ffn: int, **kw) -> OPTConfig:
    base = dict(
        vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=hidden,
        do_layer_norm_before=True, activation_function="relu", enable_bias=True,
        tie_word_embeddings=True, pad_token_id=1, bos_token_id=2, eos_token_id=2,
    )
    base.update(kw)
    cfg = OPTConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, ffn_dim=ffn,
        **base,
    )
    cfg.architectures = ["OPTForCausalLM"]
    return cfg


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
"""Llama 3.1's RoPE scaling: 8k positions trained, stretched to 128k."""


def _llama31_8b() -> LlamaConfig:
    """Meta-Llama-3.1-8B(-Instruct)'s shape: 32 layers, GQA 32/8, 128k positions."""
    cfg = _llama(4096, 32, 32, 8, 14336, vocab_size=128256, max_position_embeddings=131072,
                 bos_token_id=128000, eos_token_id=128001)
    _set_rope(cfg, LLAMA3_ROPE)
    return cfg


def _set_rope(cfg: PretrainedConfig, rope: dict) -> None:
    """Rope settings as transformers 5 spells them (``rope_parameters``), which
    :func:`pensieve.layers.rotary.rope_config` reads first."""
    cfg.rope_parameters = dict(rope)


def _qwen(cls: type, hidden: int, layers: int, heads: int, kv_heads: int, inter: int,
          positions: int, vocab: int, arch: str, **kw) -> PretrainedConfig:
    cfg = cls(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
              num_key_value_heads=kv_heads, intermediate_size=inter, vocab_size=vocab,
              max_position_embeddings=positions, rms_norm_eps=1e-6, hidden_act="silu",
              tie_word_embeddings=False, use_sliding_window=False, bos_token_id=151643,
              eos_token_id=151645, **kw)
    _set_rope(cfg, {"rope_type": "default", "rope_theta": 1000000.0})
    cfg.architectures = [arch]
    return cfg


PRESETS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama3.1-8b": _llama31_8b,
    # Qwen2.5-7B(-Instruct): q/k/v biases, GQA 28/4, 32k positions (128k only with YaRN).
    "qwen2.5-7b": lambda: _qwen(Qwen2Config, 3584, 28, 28, 4, 18944, 32768, 152064,
                                "Qwen2ForCausalLM"),
    # Qwen3-8B: per-head q/k RMSNorm, GQA 32/8, head_dim 128, 40k positions.
    "qwen3-8b": lambda: _qwen(Qwen3Config, 4096, 36, 32, 8, 12288, 40960, 151936,
                              "Qwen3ForCausalLM", head_dim=128),
    "llama2-7b": lambda: _llama(4096, 32, 32, 32, 11008),
    "llama2-13b": lambda: _llama(5120, 40, 40, 40, 13824),
    "llama2-13b-gqa10": lambda: _llama(5120, 40, 40, 10, 13824),
    "llama2-70b": lambda: _llama(8192, 80, 64, 8, 28672),
    "llama-tiny": lambda: _llama(64, 2, 4, 2, 128, vocab_size=1000, max_position_embeddings=512),
    "opt-125m": lambda: _opt(768, 12, 12, 3072),
    "opt-350m": lambda: _opt(1024, 24, 16, 4096, word_embed_proj_dim=512,
                             do_layer_norm_before=False),
    "opt-13b": lambda: _opt(5120, 40, 40, 20480),
    "opt-30b": lambda: _opt(7168, 48, 56, 28672),
    "opt-66b": lambda: _opt(9216, 64, 72, 36864),
    "opt-tiny": lambda: _opt(64, 2, 4, 128, vocab_size=1000, max_position_embeddings=512),
}


def make_dummy_config(name: str) -> PretrainedConfig:
    """A fresh HF config of the named shape (see :data:`PRESETS`)."""
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]()


def llama2_13b_gqa10() -> LlamaConfig:
    return PRESETS["llama2-13b-gqa10"]()  # type: ignore[return-value]


def llama2_70b() -> LlamaConfig:
    return PRESETS["llama2-70b"]()  # type: ignore[return-value]


def opt_13b() -> OPTConfig:
    return PRESETS["opt-13b"]()  # type: ignore[return-value]


def opt_66b() -> OPTConfig:
    return PRESETS["opt-66b"]()  # type: ignore[return-value]
