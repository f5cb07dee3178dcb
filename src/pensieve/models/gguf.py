"""GGUF checkpoints (llama.cpp's single-file format): HF config, weights and tokenizer.

A ``.gguf`` file holds metadata (architecture, shapes, rope, tokenizer vocab and merges, chat
template) and tensors under llama.cpp's names, often quantized. This module reads it with the
``gguf`` package and gives the engine what an HF checkpoint directory would:

* :func:`gguf_config` -- an HF config (``LlamaConfig`` / ``MistralConfig`` / ``Qwen2Config`` /
  ``Qwen3Config``) built from the metadata;
* :func:`iter_gguf_tensors` -- ``(hf_name, float32 tensor)`` pairs, dequantized at load
  (:data:`SUPPORTED_QUANTS`) and renamed to HF's names. For the ``llama`` / ``mistral``
  architectures llama.cpp's converter permuted the rows of ``q_proj`` / ``k_proj`` within each
  head (interleaved rotary pairs); we undo it to get HF's rotate-half layout:

      gguf rows of one head:  [x0 y0 x1 y1 ... ]   (pairs (x_i, y_i) rotate together)
      HF rows of that head:   [x0 x1 ... | y0 y1 ...]

  Qwen2 / Qwen3 files are converted without that permutation and are taken as they are;
* :func:`gguf_tokenizer` -- the tokenizer and chat template, through transformers' GGUF
  tokenizer conversion (offline, from the file alone);
* :func:`convert_gguf` -- all three written out as an HF directory (safetensors, config,
  tokenizer), so that a later start skips the dequantization and the tokenizer conversion.

Architectures, quant types and layouts outside what is listed here fail with a ``ValueError``
naming what was found.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
"""GGUF ``general.architecture`` -> the HF architecture we build."""
SUPPORTED_QUANTS = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
"""GGML tensor types dequantized at load (with ``gguf.quants.dequantize``)."""
_PERMUTED_ARCHS = ("llama", "mistral")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def is_gguf(path: str | os.PathLike) -> bool:
    """True for an existing file that starts with the GGUF magic bytes."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


@functools.lru_cache(maxsize=4)
def _reader(path: str, mtime_ns: int) -> Any:
    import gguf

    return gguf.GGUFReader(path)


def _open(path: str | os.PathLike) -> Any:
    p = os.path.abspath(os.fspath(path))
    return _reader(p, os.stat(p).st_mtime_ns)


def _metadata(reader: Any) -> dict[str, Any]:
    """Scalar and short-array metadata (the tokenizer's long arrays are left out)."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.split(".")[-1] in (
            "tokens", "token_type", "scores", "merges"):
            continue
        out[key] = field.contents()
    return out


def gguf_config(path: str | os.PathLike) -> Any:
    """The HF config of a GGUF file, from its metadata (no tensor is read)."""
    import transformers

    reader = _open(path)
    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    names = {t.name for t in reader.tensors}

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata has no {arch}.{key}")
        if isinstance(value, list):
            raise ValueError(f"{path}: per-layer {arch}.{key} is not supported")
        return value

    if "rope_freqs.weight" in names:
        raise ValueError(f"{path}: per-dimension rope frequency factors (rope_freqs, Llama 3.1 "
                         "style rope scaling) are not supported in GGUF files")
    if any(n.startswith("blk.0.ffn_gate_exps") or n.startswith("blk.0.ffn_gate_inp")
           for n in names):
        raise ValueError(f"{path}: mixture-of-experts GGUF files are not supported")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"{path}: partial rotary embeddings are not supported")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(get("rope.freq_base",
                                                                            10000.0))}
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=float(get("rope.scaling.factor")))
    elif scaling not in ("none", None):
        raise ValueError(f"{path}: rope scaling {scaling!r} is not supported in GGUF files")
    vocab = meta.get(f"{arch}.vocab_size") or _embedding_rows(reader)
    kw: dict[str, Any] = dict(
        vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")), num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)), head_dim=head_dim,
        max_position_embeddings=int(get("context_length", 4096)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=rope, tie_word_embeddings="output.weight" not in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )
    if arch in ("llama", "mistral"):
        kw["attention_bias"] = "blk.0.attn_q.bias" in names
    if arch == "mistral":
        kw["sliding_window"] = meta.get("mistral.attention.sliding_window")
    if arch == "qwen2":
        kw["use_sliding_window"] = False
    if arch == "qwen3":
        kw["attention_bias"] = "blk.0.attn_q.bias" in names
    config_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                  "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[arch]
    cfg = config_cls(**kw)
    cfg.architectures = [ARCHITECTURES[arch]]
    return cfg


def _embedding_rows(reader: Any) -> int:
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            return int(t.shape[-1])
    raise ValueError("GGUF file has no token_embd.weight")


def hf_tensor_name(name: str) -> str:
    """llama.cpp tensor name -> HF name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``); ``ValueError`` for names we do not map."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"GGUF tensor {name!r} has no HF counterpart we know")


def unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: ``w [n_heads * Dh, ...]`` (interleaved rotary pairs
    within each head) -> HF's rotate-half row order, same shape."""
    shape = w.shape
    dh = shape[0] // n_heads
    return w.reshape(n_heads, dh // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def dequantize(tensor: Any) -> np.ndarray:
    """One ``gguf.ReaderTensor`` -> float32 array in HF (row-major ``[out, in]``) shape."""
    import gguf

    qtype = tensor.tensor_type
    if qtype.name not in SUPPORTED_QUANTS:
        raise ValueError(f"GGUF tensor {tensor.name!r} has quant type {qtype.name}, not "
                         f"supported (supported: {', '.join(SUPPORTED_QUANTS)})")
    arr = gguf.quants.dequantize(tensor.data, qtype)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return np.asarray(arr, dtype=np.float32).reshape(shape)


def iter_gguf_tensors(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 CPU tensor)`` for every tensor of the file, dequantized, with
    q/k rows put back in HF's order where llama.cpp permuted them."""
    reader = _open(path)
    cfg = gguf_config(path)
    arch = str(reader.fields["general.architecture"].contents())
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        w = torch.from_numpy(np.array(dequantize(t)))  # a private, writable copy
        if arch in _PERMUTED_ARCHS:
            if ".q_proj." in name:
                w = unpermute_rotary(w, heads)
            elif ".k_proj." in name:
                w = unpermute_rotary(w, kv_heads)
        yield name, w


def gguf_tokenizer(path: str | os.PathLike) -> Any:
    """The file's tokenizer (with its chat template) through transformers' GGUF conversion;
    ``ValueError`` if the file has none or transformers cannot convert it."""
    from transformers import AutoTokenizer

    p = Path(path).resolve()
    if "tokenizer.ggml.model" not in _open(p).fields:
        raise ValueError(f"{p} holds no tokenizer: pass token ids")
    try:
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name,
                                             local_files_only=True)
    except (OSError, ValueError, KeyError, NotImplementedError) as e:
        raise ValueError(f"cannot build a tokenizer from {p}: {e}") from e


def convert_gguf(path: str | os.PathLike, out_dir: str | os.PathLike,
                 dtype: torch.dtype = torch.float16) -> str:
    """Write ``path`` as an HF checkpoint directory (``model.safetensors`` in ``dtype``,
    ``config.json``, the tokenizer files when the GGUF has a tokenizer); atomic (built in a
    temporary sibling directory, then renamed). Returns ``out_dir``."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        cfg = gguf_config(path)
        cfg.dtype = dtype
        count = len(_open(path).tensors)
        print(f"pensieve: converting {Path(path).name} into {out} (once; later starts read "
              "that directory)", file=sys.stderr, flush=True)
        tensors = {name: w.to(dtype).contiguous() for name, w in tqdm(
            iter_gguf_tensors(path), total=count, desc="dequantizing", unit="tensor",
            file=sys.stderr, mininterval=0.5)}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg.save_pretrained(tmp)
        if "tokenizer.ggml.model" in _open(path).fields:
            print("pensieve: converting the tokenizer and chat template", file=sys.stderr,
                  flush=True)
            gguf_tokenizer(path).save_pretrained(tmp)
        (tmp / "SOURCE.json").write_text(json.dumps({"gguf": str(Path(path).resolve())}) + "\n")
        try:
            tmp.rename(out)  # a concurrent converter loses the race harmlessly
        except OSError:
            if not (out / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)
