"""GGUF checkpoints (:mod:`pensieve.models.gguf`) against HF transformers, fp32 on the CPU.

Each test builds a tiny random HF model, writes it as a GGUF file the way llama.cpp's converter
does (its tensor names; q/k rows permuted for the ``llama`` architecture, not for Qwen), and
checks that ``LLM("model.gguf")`` gives HF's greedy tokens. Quantized files are checked
against transformers' own GGUF reader (independent name mapping and q/k un-permutation).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from tiny_hf import hf_greedy, ours_greedy, tiny_hf

from pensieve import LLM
from pensieve.models.gguf import convert_gguf, gguf_config, hf_tensor_name, iter_gguf_tensors
from pensieve.models.loader import resolve_config
from pensieve.models.tokenizer import load_tokenizer

Q = gguf.GGMLQuantizationType

_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF rotate-half rows -> interleaved pairs)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


# byte offsets of the f16 super-block scales (d, and dmin where there is one) in K-quant blocks
_K_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def _random_blocks(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with small scales (gguf has no numpy quantizer for them); zeros
    for other types."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype not in _K_SCALES:
        return np.zeros((rows, cols // block * size), np.uint8)
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(1e-5).tobytes(), np.uint8)
    for offset in _K_SCALES[qtype]:
        raw[..., offset:offset + 2] = scale
    return raw.reshape(rows, -1)


def write_gguf(hf_model, path, arch: str, quant: dict[str, Q] | None = None) -> str:
    """Write ``hf_model`` as GGUF (F32 unless ``quant`` maps a name fragment to a type)."""
    cfg = hf_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    rng = np.random.default_rng(0)
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            a = _llama_cpp_permute(a, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            a = _llama_cpp_permute(a, cfg.num_key_value_heads)
        qtype = next((q for frag, q in (quant or {}).items() if frag in name), None)
        if qtype is None or a.ndim == 1:
            w.add_tensor(_gguf_name(name), np.ascontiguousarray(a))
        elif qtype in _K_SCALES or qtype == Q.IQ2_XXS:
            w.add_tensor(_gguf_name(name), _random_blocks(*a.shape, qtype, rng), raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


CASES = {
    "llama_gqa": ("llama", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"head_dim": 32}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_f32_gguf_greedy_matches_hf(case, tmp_path):
    kind, kw = CASES[case]
    hf = tiny_hf(kind, **kw)
    path = write_gguf(hf, tmp_path / f"{case}.gguf", kind)
    cfg, src = resolve_config(path)
    assert src == path and cfg.architectures == [type(hf).__name__]
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    ours = dict(iter_gguf_tensors(path))
    ref = {k: v for k, v in hf.state_dict().items()
           if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
    assert ours.keys() == ref.keys()
    for k in ref:  # F32 round trip: bit-identical, permutation undone
        assert torch.equal(ours[k], ref[k]), k
    assert ours_greedy(path) == hf_greedy(hf)


def test_quantized_gguf_matches_transformers_reader(tmp_path):
    """Every supported type in one Llama file: our dequantized, un-permuted tensors equal
    transformers' GGUF reader's, and greedy tokens equal HF's on them."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from pensieve.models.gguf import SUPPORTED_QUANTS

    hf = tiny_hf("llama", intermediate_size=256, num_hidden_layers=5)
    quant = {"q_proj": Q.Q8_0, "k_proj": Q.Q4_0, "v_proj": Q.Q4_1, "o_proj": Q.F16,
             "layers.0.mlp.gate_proj": Q.Q5_0, "gate_proj": Q.BF16, "layers.0.mlp.up_proj":
             Q.Q5_1, "up_proj": Q.Q8_0, "embed_tokens": Q.Q8_0}
    for layer, k in enumerate((Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)):
        quant[f"layers.{layer}.mlp.down_proj"] = k
    path = write_gguf(hf, tmp_path / "quant.gguf", "llama", quant)
    reader = gguf.GGUFReader(path)
    assert {t.tensor_type.name for t in reader.tensors} == set(SUPPORTED_QUANTS)
    ref = load_gguf_checkpoint(path, return_tensors=True, model_to_load=hf)["tensors"]
    ours = dict(iter_gguf_tensors(path))
    assert ours.keys() == ref.keys()
    for k, v in ours.items():
        assert torch.equal(v, torch.as_tensor(ref[k]).float()), k
        assert torch.isfinite(v).all(), k
    hf.load_state_dict(ours, strict=True)
    assert ours_greedy(path) == hf_greedy(hf)


def test_unsupported_architecture_and_quant_type_fail_clearly(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "arch.gguf"), "phi3")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'phi3' is not supported"):
        gguf_config(tmp_path / "arch.gguf")
    with pytest.raises(ValueError, match="architecture 'phi3' is not supported"):
        LLM(str(tmp_path / "arch.gguf"), device="cpu")
    hf = tiny_hf("llama", intermediate_size=256)
    iq = write_gguf(hf, tmp_path / "iq.gguf", "llama", {"down_proj": Q.IQ2_XXS})
    with pytest.raises(ValueError, match="quant type IQ2_XXS, not supported"):
        dict(iter_gguf_tensors(iq))


def test_unknown_tensor_name_and_missing_tokenizer(tmp_path):
    assert hf_tensor_name("blk.7.attn_q.bias") == "model.layers.7.self_attn.q_proj.bias"
    with pytest.raises(ValueError, match="no HF counterpart"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")
    path = write_gguf(tiny_hf("qwen2"), tmp_path / "notok.gguf", "qwen2")
    with pytest.raises(ValueError, match="holds no tokenizer"):
        load_tokenizer(path)


def test_conversion_says_what_it_does(tmp_path, capsys):
    """The first start of the default model converts its GGUF (~10 s on a busy 2-core CPU):
    it says so, where to, and shows its progress over the tensors, instead of being silent."""
    hf = tiny_hf("llama")
    path = write_gguf(hf, tmp_path / "tiny.gguf", "llama")
    out = convert_gguf(path, tmp_path / "converted")
    err = capsys.readouterr().err
    n = len(gguf.GGUFReader(path).tensors)
    assert f"converting tiny.gguf into {out}" in err, err
    assert "dequantizing: 100%" in err and f"{n}/{n}" in err, err
    assert (tmp_path / "converted" / "model.safetensors").is_file()
