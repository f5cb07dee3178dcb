"""On CUDA in bf16: our greedy outputs against HF transformers', compared the way vLLM does.

bf16 rounding differs between any two implementations, so exact token equality is not
expected. Both run greedy; the outputs must agree up to the first position where they differ,
and there our token must be among HF's ``TOP_K`` most likely ones, as vLLM's
``check_logprobs_close`` asks. (On the H200 the Llama case diverged at a second-ranked token
0.22 logits below HF's first, about seven bf16 steps: bf16 rounding differs through the whole
network, not only in the logits.) Random small models have flat distributions, so near-ties
come early; a wrong implementation diverges on tokens far from HF's choice.
Skipped without CUDA (CI has none); run on the H200.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from pensieve import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOP_K = 5
MAX_NEW = 32


def _build(kind: str, path: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if kind == "opt":
        cfg = transformers.OPTConfig(vocab_size=4096, hidden_size=512, num_hidden_layers=4,
                                     ffn_dim=2048, num_attention_heads=8, init_std=0.05,
                                     max_position_embeddings=2048, word_embed_proj_dim=512)
        model = transformers.OPTForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408,
                                       num_hidden_layers=4, num_attention_heads=8,
                                       num_key_value_heads=2, head_dim=64,
                                       max_position_embeddings=4096, initializer_range=0.05)
        model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)
    return model.to("cuda", torch.bfloat16).eval()


@pytest.mark.parametrize("kind", ["llama-gqa", "opt"])
def test_bf16_greedy_close_to_hf(kind: str, tmp_path) -> None:  # noqa: ANN001
    hf = _build(kind, str(tmp_path))
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 4096) for _ in range(n)] for n in (1, 17, 100, 513, 1500)]
    llm = LLM(model=str(tmp_path), dtype="bfloat16", device="cuda", gpu_kv_gb=1.0)
    ours = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                ignore_eos=True))
    agreed = 0
    leading: list[int] = []  # tokens equal to HF's before the first difference, per prompt
    for p, o in zip(prompts, ours):
        ids = torch.tensor([p], device="cuda")
        with torch.no_grad():
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, eos_token_id=None,
                            pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        theirs = g.sequences[0, len(p):].tolist()
        for i, (a, b) in enumerate(zip(o.output_token_ids, theirs)):
            if a != b:
                logits = g.scores[i][0].float()
                rank = int((logits > logits[a]).sum())
                gap = (logits[b] - logits[a]).item()
                assert rank < TOP_K, (
                    f"prompt {len(p)}: token {i} differs: rank {rank}, logit gap {gap:.4f}")
                break
            agreed += 1
        leading.append(agreed - sum(leading))
    # bf16 ties only show after some tokens: every prompt's first token equals HF's, and on
    # average the first 4 of 32 at least (the H200 run diverged at token 10 at the earliest)
    assert min(leading) >= 1 and agreed >= 4 * len(prompts), f"agreed prefixes {leading}"
