"""Steps replayed from CUDA graphs give the tokens of the eager path (GPU only).

Both engines are float32 on the same GPU with the same random checkpoint; the graph engine
pads decode batches to its buckets (1, 2, 4, 8) and every other step to its token buckets (16,
32, 64, 128) with empty range slots, so the padded rows and the empty ranges are covered, and
a multi-turn round under a tiny GPU tier mixes swap-ins into graph steps.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from tiny_hf import assert_same_turns, swap_llm_kwargs

from pensieve import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("kind", ["llama-gqa", "opt"])
def test_graph_decode_matches_eager(tmp_path, kind: str) -> None:  # noqa: ANN001
    """The runner's defaults: a mixed step's decodes in a decode launch of their own, split
    by span in the graphs; the mixed-step graphs' other ranges split KV by span."""
    torch.manual_seed(0)
    if kind == "opt":
        cfg = transformers.OPTConfig(vocab_size=512, hidden_size=128, num_hidden_layers=2,
                                     ffn_dim=256, num_attention_heads=4, init_std=0.1,
                                     max_position_embeddings=1024, word_embed_proj_dim=128)
        hf = transformers.OPTForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                                       num_hidden_layers=2, num_attention_heads=8,
                                       num_key_value_heads=2, max_position_embeddings=1024,
                                       initializer_range=0.1)
        hf = transformers.LlamaForCausalLM(cfg)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    common = swap_llm_kwargs(tmp_path)  # always swap: the test is about swap-ins
    graph = LLM(**common)
    eager = LLM(**common, enforce_eager=True)
    assert graph.engine.runner.decode_graphs is not None
    assert graph.engine.runner.decode_graphs.buckets == [1, 2, 4, 8]
    assert eager.engine.runner.decode_graphs is None
    assert graph.engine.runner.mixed_graphs is not None
    assert graph.engine.runner.mixed_graphs.buckets == [16, 32, 64, 96, 128]
    assert graph.engine.runner.mixed_graphs.split_decodes
    assert graph.engine.runner.mixed_graphs.kv_splits
    assert graph.engine.runner.mixed_graphs._items_splits(16) == 32
    assert eager.engine.runner.mixed_graphs is None
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (1, 7, 40, 100, 3, 260)]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = [[o.output_token_ids for o in llm.generate(prompts, greedy)] for llm in (graph, eager)]
    assert outs[0] == outs[1]
    # multi-turn under a tiny GPU tier: swaps and drops around the graph steps
    assert_same_turns([graph, eager], rng, rounds=2)
    assert graph.engine.runner.num_graph_steps > 0
    assert graph.engine.runner.num_span_graph_steps > 0  # ragged batches: split by span
    assert graph.engine.runner.num_mixed_graph_steps > 0
    assert graph.cache_stats()["swapped_in_tokens"] > 0
