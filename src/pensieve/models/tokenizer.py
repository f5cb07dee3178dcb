"""Tokenizers through HF transformers, from a local checkpoint directory only."""

from __future__ import annotations

import os
from typing import Any


def load_tokenizer(model: str) -> Any:
    """The tokenizer saved beside a checkpoint; a clear error when there is none."""
    if model == "demo":
        from pensieve.models.demo import ensure_demo_checkpoint

        model = ensure_demo_checkpoint()
    if not os.path.isdir(model):
        raise ValueError(
            f"model {model!r} has no tokenizer (a preset or the demo model): pass token ids, "
            "or a checkpoint directory that holds tokenizer files"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"no usable tokenizer in {model}: {e}") from e
