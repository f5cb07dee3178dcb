"""Tokenizers through HF transformers, from local files only: a checkpoint directory, a
``.gguf`` file (converted from its metadata) or a built-in model name."""

from __future__ import annotations

import os
from typing import Any


def load_tokenizer(model: str) -> Any:
    """The tokenizer saved beside a checkpoint (or inside a GGUF file); a clear error when there
    is none."""
    from pensieve.models.builtin import resolve_builtin
    from pensieve.models.gguf import gguf_tokenizer, is_gguf

    model = resolve_builtin(os.fspath(model)) or os.fspath(model)
    if is_gguf(model):
        return gguf_tokenizer(model)
    if not os.path.isdir(model):
        raise ValueError(
            f"model {model!r} has no tokenizer (a preset shape): pass token ids, "
            "or a checkpoint directory that holds tokenizer files"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"no usable tokenizer in {model}: {e}") from e
