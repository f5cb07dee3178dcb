"""Our Llama / Qwen2 / Qwen3 / OPT over the paged KV cache against HF transformers, in float32
on the CPU.

Each case builds a tiny random HF model, saves it as safetensors, loads it with our loader and
compares logits: batched prefill of prompts of 1..200 tokens, batched decode steps, split
prefills, and a step recomputing a dropped prefix as a second range sharing the block table.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import pytest
import torch
import transformers

from pensieve.layers.attention import AttentionMetadata
from pensieve.layers.rotary import RotaryEmbedding, rope_config
from pensieve.models import get_model_class
from pensieve.models.loader import build_model, iter_checkpoint, load_model
from pensieve.models.presets import make_dummy_config

VOCAB = 1000
PROMPT_LENS = [1, 5, 16, 33, 97, 200]
DECODE_STEPS = 3
ATOL = 1e-4


def _llama(**kw):
    base = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
        initializer_range=0.08, tie_word_embeddings=False,
    )
    base.update(kw)
    return transformers.LlamaConfig(**base)


def _opt(**kw):
    base = dict(
        vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=512, word_embed_proj_dim=64,
        init_std=0.08, dropout=0.0, do_layer_norm_before=True,
    )
    base.update(kw)
    return transformers.OPTConfig(**base)


@dataclass
class Case:
    make_config: object
    chunk_size: int
    max_shard_size: str | None = None
    perturb: bool = False
    """Randomize biases and norm weights (HF initialises them to 0 / 1, which would hide a
    bias or a q/k norm that is loaded but not applied)."""


CASES = {
    "llama_mha": Case(lambda: _llama(), 16),
    "llama_gqa_sharded": Case(
        lambda: _llama(num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3),
        32, max_shard_size="200KB",
    ),
    "llama_tied_llama3_bias_headdim": Case(
        lambda: _llama(
            tie_word_embeddings=True, head_dim=32, attention_bias=True, mlp_bias=True,
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        16,
    ),
    "mistral_yarn": Case(
        lambda: transformers.MistralConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.08, sliding_window=None, tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        ),
        32,
    ),
    "qwen2_bias_tied": Case(
        lambda: transformers.Qwen2Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.08, tie_word_embeddings=True, rope_theta=1000000.0,
        ),
        16, perturb=True,
    ),
    "qwen3_qk_norm_headdim": Case(
        lambda: transformers.Qwen3Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=512, initializer_range=0.08, tie_word_embeddings=False,
        ),
        32, perturb=True,
    ),
    "opt_project_in_out": Case(lambda: _opt(word_embed_proj_dim=32), 16),
    "opt_post_norm": Case(
        lambda: _opt(do_layer_norm_before=False, word_embed_proj_dim=48, num_hidden_layers=3),
        32,
    ),
}


# ----------------------------------------------------------------------------- fixtures


def _save(hf_model, path, max_shard_size):
    kw = {}
    if "safe_serialization" in inspect.signature(hf_model.save_pretrained).parameters:
        kw["safe_serialization"] = True
    if max_shard_size:
        kw["max_shard_size"] = max_shard_size
    hf_model.save_pretrained(path, **kw)


@torch.no_grad()
def _hf_reference(hf_model, prompt):
    """Greedy-extend ``prompt`` by DECODE_STEPS tokens; return (full token list, logits [L, V])."""
    seq = list(prompt)
    for _ in range(DECODE_STEPS):
        logits = hf_model(torch.tensor([seq])).logits[0]
        seq.append(int(logits[-1].argmax()))
    return seq, hf_model(torch.tensor([seq])).logits[0].float()


class Setup:
    def __init__(self, name, case, tmp_path_factory):
        torch.manual_seed(0)
        cfg = case.make_config()
        hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
        self.hf = hf.float().eval()
        if case.perturb:
            with torch.no_grad():
                for n, p in self.hf.named_parameters():
                    if n.endswith("bias"):
                        p.normal_(0.0, 0.5)
                    elif "norm" in n:
                        p.uniform_(0.5, 1.5)
        self.path = str(tmp_path_factory.mktemp(name))
        _save(self.hf, self.path, case.max_shard_size)
        self.model, self.config = load_model(self.path, torch.float32, "cpu")
        self.chunk_size = case.chunk_size
        g = torch.Generator().manual_seed(1)
        self.prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
        refs = [_hf_reference(self.hf, p) for p in self.prompts]
        self.seqs = [s for s, _ in refs]
        self.ref = [r for _, r in refs]


@pytest.fixture(scope="module", params=list(CASES))
def setup(request, tmp_path_factory):
    return Setup(request.param, CASES[request.param], tmp_path_factory)


# ----------------------------------------------------------------------------- paged runner


class PagedRunner:
    """Minimal stand-in for the engine's runner: KV caches, shuffled block tables, metadata."""

    def __init__(self, model, chunk_size, max_tokens_per_seq=256, num_seqs=8, seed=0):
        self.model, self.c = model, chunk_size
        blocks_per_seq = math.ceil(max_tokens_per_seq / chunk_size)
        num_blocks = blocks_per_seq * num_seqs + 3
        shape = (2, num_blocks, chunk_size, model.num_kv_heads, model.head_dim)
        dtype = next(model.parameters()).dtype
        self.kv_caches = [torch.zeros(shape, dtype=dtype) for _ in range(model.num_layers)]
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables = [perm[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(num_seqs)]

    def slot(self, seq, pos):
        return self.tables[seq][pos // self.c] * self.c + pos % self.c

    def step(self, ranges):
        """ranges: list of (seq index, start position, token ids) -> logits [T, V]."""
        ids, pos, slots, qsl = [], [], [], [0]
        for seq, start, toks in ranges:
            ids += toks
            pos += range(start, start + len(toks))
            slots += [self.slot(seq, p) for p in range(start, start + len(toks))]
            qsl.append(qsl[-1] + len(toks))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            range_start_pos=torch.tensor([r[1] for r in ranges], dtype=torch.int32),
            range_table=torch.tensor([r[0] for r in ranges], dtype=torch.int32),
            block_tables=torch.tensor(self.tables, dtype=torch.int32),
            max_query_len=max(len(r[2]) for r in ranges),
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.kv_caches, meta)
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (len(ids), self.model.vocab_size)
        return logits.split([len(r[2]) for r in ranges])


def _close(ours, ref, what):
    err = (ours - ref).abs().max().item()
    assert err < ATOL, f"{what}: max abs err {err:.2e} (logit scale {ref.abs().max():.2f})"


# ----------------------------------------------------------------------------- tests


def test_load_fills_every_parameter(setup):
    names = {n for n, _ in setup.model.named_parameters()}
    filled = setup.model.load_weights(iter_checkpoint(setup.path, torch.device("cpu")))
    assert filled == names
    for p in setup.model.parameters():
        assert p.dtype == torch.float32 and p.device.type == "cpu"
    if getattr(setup.config, "tie_word_embeddings", False) and hasattr(setup.model, "lm_head"):
        assert setup.model.lm_head.weight is setup.model.model.embed_tokens.weight


def test_prefill_matches_hf(setup):
    runner = PagedRunner(setup.model, setup.chunk_size)
    out = runner.step([(i, 0, p) for i, p in enumerate(setup.prompts)])
    for i, p in enumerate(setup.prompts):
        _close(out[i], setup.ref[i][: len(p)], f"prompt {i} (len {len(p)})")


def test_decode_matches_hf(setup):
    runner = PagedRunner(setup.model, setup.chunk_size)
    out = runner.step([(i, 0, p) for i, p in enumerate(setup.prompts)])
    for i, p in enumerate(setup.prompts):
        assert int(out[i][-1].argmax()) == setup.seqs[i][len(p)]
    for j in range(DECODE_STEPS):
        ranges = [(i, len(p) + j, [setup.seqs[i][len(p) + j]]) for i, p in enumerate(setup.prompts)]
        out = runner.step(ranges)
        for i, p in enumerate(setup.prompts):
            _close(out[i][0], setup.ref[i][len(p) + j], f"decode step {j} of prompt {i}")


def test_split_prefill_matches_hf(setup):
    runner = PagedRunner(setup.model, setup.chunk_size, seed=1)
    prompts = [(i, p) for i, p in enumerate(setup.prompts) if len(p) >= 2]
    halves = [len(p) // 2 for _, p in prompts]
    first = runner.step([(i, 0, p[:h]) for (i, p), h in zip(prompts, halves, strict=True)])
    second = runner.step([(i, h, p[h:]) for (i, p), h in zip(prompts, halves, strict=True)])
    for k, ((i, p), h) in enumerate(zip(prompts, halves, strict=True)):
        _close(first[k], setup.ref[i][:h], f"first half of prompt {i}")
        _close(second[k], setup.ref[i][h : len(p)], f"second half of prompt {i}")


def test_mixed_step_and_recomputed_prefix(setup):
    """One step holding a decode, a prefill, and a request whose dropped prefix is recomputed as
    range 0 while its new tokens form range 1 (both through the same block table)."""
    runner = PagedRunner(setup.model, setup.chunk_size, seed=2)
    a, b, c = 3, 4, 5  # prompts of 33, 97, 200 tokens
    pa, pb, pc = (setup.prompts[k] for k in (a, b, c))
    runner.step([(a, 0, pa), (c, 0, pc)])
    # Drop (zero) the cached K/V of the first `d` positions of request c.
    d = 50
    for cache in runner.kv_caches:
        for pos in range(d):
            blk, off = divmod(runner.slot(c, pos), runner.c)
            cache[:, blk, off] = 0
    new_c = setup.seqs[c][len(pc) :]
    out = runner.step([
        (a, len(pa), [setup.seqs[a][len(pa)]]),
        (b, 0, pb),
        (c, 0, pc[:d]),
        (c, len(pc), new_c),
    ])
    _close(out[0][0], setup.ref[a][len(pa)], "decode of a")
    _close(out[1], setup.ref[b][: len(pb)], "prefill of b")
    _close(out[2], setup.ref[c][:d], "recomputed prefix of c")
    _close(out[3], setup.ref[c][len(pc) :], "new tokens of c")


# ----------------------------------------------------------------------------- rope, loader


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 128,
    },
    "yarn": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 128,
    },
}


@pytest.mark.parametrize("kind", list(ROPES))
def test_rotary_matches_hf(kind):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = _llama(hidden_size=128, num_attention_heads=2, rope_parameters=dict(ROPES[kind]))
    ours = RotaryEmbedding(cfg)
    hf = LlamaRotaryEmbedding(cfg)
    pos = torch.tensor([0, 1, 7, 100, 300, 511, 3])
    cos, sin = ours(pos)
    hf_cos, hf_sin = hf(torch.zeros(1, dtype=torch.float32), pos[None])
    torch.testing.assert_close(cos, hf_cos[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sin, hf_sin[0], atol=1e-6, rtol=1e-6)
    assert rope_config(cfg)[0] == kind


def test_rope_config_old_style():
    class Old:  # a transformers-4-style config: rope_scaling + rope_theta
        rope_scaling = {"type": "linear", "factor": 2.0}
        rope_theta = 1234.0

    assert rope_config(Old()) == ("linear", 1234.0, {"type": "linear", "factor": 2.0})
    cfg = _llama(rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=1234.0)
    rope_type, theta, _ = rope_config(cfg)
    assert (rope_type, theta) == ("linear", 1234.0)


def test_missing_parameter_is_reported(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    cfg = _llama()
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    del state["model.layers.1.mlp.up_proj.weight"], state["model.norm.weight"]
    cfg.save_pretrained(tmp_path)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.gate_up_proj.weight.*model.norm"):
        load_model(str(tmp_path), torch.float32, "cpu")


@pytest.mark.parametrize("name", ["llama-tiny", "opt-tiny"])
def test_dummy_weights_from_preset(name):
    model, cfg = load_model(name, torch.bfloat16, "cpu", load_format="dummy")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    runner = PagedRunner(model, 16, num_seqs=2)
    out = runner.step([(0, 0, list(range(40))), (1, 0, list(range(7)))])
    assert all(torch.isfinite(o).all() for o in out)


def test_presets_shapes_on_meta():
    expect = {  # name: (layers, kv heads, head_dim, billions of parameters)
        "llama2-13b-gqa10": (40, 10, 128, 11.44),
        "llama2-70b": (80, 8, 128, 69.0),
        "opt-13b": (40, 40, 128, 12.9),
        "opt-66b": (64, 72, 128, 65.7),
    }
    for name, (layers, kv, hd, billions) in expect.items():
        cfg = make_dummy_config(name)
        model = build_model(cfg, torch.bfloat16, "meta")
        assert isinstance(model, get_model_class(cfg))
        assert (model.num_layers, model.num_kv_heads, model.head_dim) == (layers, kv, hd)
        n = sum(p.numel() for p in model.parameters()) / 1e9
        assert abs(n - billions) < 0.1, (name, n)
