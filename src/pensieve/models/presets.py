"""Named model shapes as HF config objects, for dummy-weight benchmarks without any files.

``make_dummy_config("llama2-13b-gqa10")`` -> a ``transformers.LlamaConfig``; pass it (or just the
name) to :func:`pensieve.models.loader.load_model` with ``load_format="dummy"``.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import LlamaConfig, OPTConfig, PretrainedConfig


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


PRESETS: dict[str, Callable[[], PretrainedConfig]] = {
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
