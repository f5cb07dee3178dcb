"""Long contexts: the 128k presets, ``max_model_len`` from the model and checked against the
GPU tier (a warning), and the engine serving a context past the old 16k default."""

from __future__ import annotations

import pytest
import torch

from pensieve.engine.executor import TierSizes
from pensieve.engine.tiers import check_fits
from pensieve.layers.rotary import rope_config
from pensieve.models import get_model_class
from pensieve.models.presets import make_dummy_config
from pensieve.options import checked_max_model_len


@pytest.mark.parametrize("name,arch,positions,kv_heads,layers", [
    ("llama3.1-8b", "LlamaForCausalLM", 131072, 8, 32),
    ("qwen2.5-7b", "Qwen2ForCausalLM", 32768, 4, 28),
    ("qwen3-8b", "Qwen3ForCausalLM", 40960, 8, 36),
])
def test_presets_shapes(name: str, arch: str, positions: int, kv_heads: int,
                        layers: int) -> None:
    cfg = make_dummy_config(name)
    assert cfg.architectures == [arch]
    assert cfg.max_position_embeddings == positions
    assert cfg.num_key_value_heads == kv_heads and cfg.num_hidden_layers == layers
    assert get_model_class(cfg).__name__ == arch
    # the server's default context is the model's own limit, not a fixed 16k
    assert checked_max_model_len(None, cfg) == positions


def test_llama31_rope_is_llama3_scaling() -> None:
    rope_type, theta, params = rope_config(make_dummy_config("llama3.1-8b"))
    assert (rope_type, theta) == ("llama3", 500000.0)
    assert params["factor"] == 8.0 and params["original_max_position_embeddings"] == 8192


def test_check_fits_refuses_a_context_the_gpu_tier_cannot_hold() -> None:
    tiers = TierSizes(num_gpu_blocks=4096, num_cpu_blocks=0, block_bytes=32 * 128 * 1024)
    assert check_fits(131072, 32, tiers) is None  # exactly 4096 chunks
    assert "max_model_len=131073 needs 4097 KV chunks" in check_fits(131073, 32, tiers)


def test_engine_warns_of_max_model_len_beyond_gpu_tier(caplog: pytest.LogCaptureFixture
                                                       ) -> None:
    from pensieve.engine.llm import LLM

    with caplog.at_level("WARNING", logger="pensieve"):
        LLM(model="llama-tiny", load_format="dummy", device="cpu", num_gpu_blocks=8,
            max_model_len=512)
    assert "GPU tier holds 8" in caplog.text


def test_engine_serves_past_16k_context() -> None:
    """A 16.5k-token prompt on a model whose positions allow it: no 16k cap anywhere."""
    from pensieve.core.sampling_params import SamplingParams
    from pensieve.engine.llm import LLM

    cfg = make_dummy_config("llama-tiny")
    cfg.max_position_embeddings = 32768
    llm = LLM(model=cfg, load_format="dummy", device="cpu", max_model_len=32768,
              max_num_batched_tokens=4096, num_gpu_blocks=1100)
    prompt = [int(x) for x in torch.randint(3, 999, (16500,), generator=torch.Generator()
                                            .manual_seed(0))]
    out = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0,
                                                ignore_eos=True))
    assert len(out[0].output_token_ids) == 2
