"""Tiny random HF models and greedy decoding with HF and with Pensieve, shared by the model
tests (GGUF, Qwen): a helper module, not a test module."""

from __future__ import annotations

import torch
import transformers

from pensieve import LLM, SamplingParams

VOCAB = 512
NEW_TOKENS = 16


def tiny_hf(kind: str, **kw):
    """A random tiny HF model (fp32, eval) with random biases and norm weights."""
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                initializer_range=0.1, tie_word_embeddings=False)
    base.update(kw)
    cfg = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config}[kind](**base)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in n:
                p.uniform_(0.5, 1.5)
    return model


PROMPTS = [[5, 17, 300, 2, 99], list(range(40, 80)), [7]]


@torch.no_grad()
def hf_greedy(model, prompts=PROMPTS, n=NEW_TOKENS) -> list[list[int]]:
    outs = []
    for p in prompts:
        ids = model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        outs.append(ids[0, len(p):].tolist())
    return outs


def ours_greedy(model_path, prompts=PROMPTS, n=NEW_TOKENS) -> list[list[int]]:
    llm = LLM(model_path, dtype="float32", device="cpu", num_gpu_blocks=64, chunk_size=16)
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return [o.output_token_ids for o in outs]


def tiny_swap_llama(path, num_layers: int = 2) -> dict:
    """A random tiny Llama (GQA) saved to ``path``, and the ``LLM`` arguments the GPU tests run
    it with: a 40-block GPU tier, a CPU tier, decode and mixed-step graphs, and every CPU chunk
    swapped in (never recomputed: the tests are about swap-ins)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=num_layers, num_attention_heads=8,
                                   num_key_value_heads=2, max_position_embeddings=1024,
                                   initializer_range=0.1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return swap_llm_kwargs(path)


def swap_llm_kwargs(path) -> dict:
    """The ``LLM`` arguments of :func:`tiny_swap_llama` for a model saved at ``path``."""
    return dict(model=str(path), dtype="float32", device="cuda", chunk_size=16,
                max_num_batched_tokens=128, max_model_len=1024, num_gpu_blocks=40,
                num_cpu_blocks=64, cuda_graph_max_batch=8, cuda_graph_mixed=True,
                swap_bandwidth_gbps="off")


def assert_same_turns(llms, rng, rounds: int) -> None:
    """``rounds`` turns of six conversations (20-60 new tokens each, 30 greedy tokens out)
    through every engine of ``llms``: each round, the same tokens from all."""
    for r in range(rounds):
        convs = [f"c{i}" for i in range(6)]
        turn = [[rng.randrange(VOCAB) for _ in range(rng.randint(20, 60))] for _ in convs]
        params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
        outs = [[o.output_token_ids for o in llm.generate(turn, params, conversation_ids=convs)]
                for llm in llms]
        assert all(o == outs[0] for o in outs), f"round {r}"
