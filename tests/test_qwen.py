"""Qwen2 and Qwen3 HF checkpoints (tiny, random weights, saved as safetensors) through ``LLM``
give HF transformers' greedy tokens (fp32, CPU); checkpoints with sliding-window attention are
refused beyond the window."""

from __future__ import annotations

import pytest
import transformers
from tiny_hf import PROMPTS, hf_greedy, ours_greedy, tiny_hf

from pensieve import LLM


@pytest.mark.parametrize("kind,kw", [
    ("qwen2", {"tie_word_embeddings": True}),
    ("qwen2", {"num_key_value_heads": 1}),
    ("qwen3", {"head_dim": 32}),
    ("qwen3", {"attention_bias": True, "tie_word_embeddings": True}),
])
def test_hf_checkpoint_greedy_matches_hf(kind, kw, tmp_path):
    hf = tiny_hf(kind, **kw)
    hf.save_pretrained(tmp_path)
    assert any(n.endswith("q_proj.bias") for n, _ in hf.named_parameters()) == (
        kind == "qwen2" or kw.get("attention_bias", False))
    assert ours_greedy(str(tmp_path), PROMPTS, 24) == hf_greedy(hf, PROMPTS, 24)


def _save_config(cfg, path):
    cfg.architectures = [f"{type(cfg).__name__.removesuffix('Config')}ForCausalLM"]
    cfg.save_pretrained(path)
    return str(path)


def test_sliding_window_beyond_max_model_len_is_refused(tmp_path):
    small = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8192)
    mistral = _save_config(transformers.MistralConfig(sliding_window=256, **small),
                           tmp_path / "mistral")
    with pytest.raises(ValueError, match="sliding-window attention \\(window 256 tokens\\)"):
        LLM(mistral, device="cpu", load_format="dummy", max_model_len=1024)
    llm = LLM(mistral, device="cpu", load_format="dummy", max_model_len=256)
    assert llm.engine.config.scheduler.max_model_len == 256
    qwen = _save_config(transformers.Qwen2Config(use_sliding_window=True, sliding_window=128,
                                                 max_window_layers=0, **small), tmp_path / "qw")
    with pytest.raises(ValueError, match="max_model_len=512 is beyond the window"):
        LLM(qwen, device="cpu", load_format="dummy", max_model_len=512)
    off = _save_config(transformers.Qwen2Config(use_sliding_window=False, sliding_window=128,
                                                **small), tmp_path / "off")
    LLM(off, device="cpu", load_format="dummy", max_model_len=512)  # window unused: accepted
