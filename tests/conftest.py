"""Fixtures shared by several test modules."""

from __future__ import annotations

from typing import Any

import pytest

TINY_LLAMA_VOCAB = 256


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    """A random Llama (vocab 256, hidden 64, 2 layers, 4 query / 2 KV heads, seed 0) saved as
    safetensors: its directory and the HF model (eval mode) to compare greedy tokens with.
    torch and transformers are imported here, not when the tests are collected."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=TINY_LLAMA_VOCAB, hidden_size=64,
                                   intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path, safe_serialization=True)
    return str(path), model
