"""The built-in random-weight model (``demo-random``, alias ``demo``): a small Llama with
random weights and a real tokenizer. (The default model is the trained SmolLM2-135M-Instruct,
see :mod:`pensieve.models.builtin`.)

Made locally on first use, with no download, under ``$PENSIEVE_CACHE_DIR`` (default
``~/.cache/pensieve``): ``config.json``, seeded random weights in ``model.safetensors``
(the same on every machine), and the 32k SentencePiece tokenizer of Mistral 7B v0.1 converted
to ``tokenizer.json`` (shipped in ``demo_tokenizer/``; Apache-2.0, from the ``mistral-common``
package) with a plain ``[INST]`` chat template. Its answers are random tokens: it exists so the
server, the cache and the benchmarks run anywhere.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DEMO_VERSION = "1"
TOKENIZER_DIR = Path(__file__).resolve().parent / "demo_tokenizer"


def demo_dir() -> Path:
    base = Path(os.environ.get("PENSIEVE_CACHE_DIR", Path.home() / ".cache" / "pensieve"))
    return base / f"demo-v{DEMO_VERSION}"


def ensure_demo_checkpoint() -> str:
    """Path of the demo checkpoint, building it (about a second) if it is not there yet."""
    target = demo_dir()
    if (target / "model.safetensors").is_file():
        return str(target)
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=16384,
        rope_theta=10000.0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        initializer_range=0.05,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".demo-"))
    try:
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        torch.random.set_rng_state(gen_state)
        model.save_pretrained(tmp, safe_serialization=True)
        for f in TOKENIZER_DIR.iterdir():
            shutil.copy(f, tmp / f.name)
        (tmp / "DEMO").write_text("Pensieve demo model: random weights, not a trained LLM.\n")
        try:
            tmp.rename(target)  # atomic: a concurrent builder loses the race harmlessly
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def is_demo(path: str | None) -> bool:
    return path is not None and (Path(path) / "DEMO").is_file()
