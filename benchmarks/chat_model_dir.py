"""A model directory that ``pensieve serve`` can chat with: a preset's shape, the demo tokenizer.

The presets (``llama2-13b-gqa10``, ...) carry no tokenizer, so a server started on one serves
token ids only and ``/v1/chat/completions`` is off. For an ordinary chat client against
dummy weights of that shape, this writes ``config.json`` of the preset and the demo model's
tokenizer (Mistral's 32k SentencePiece vocabulary, a plain ``[INST]`` template) into a
directory; serve it with ``--load-format dummy`` (the weights are the preset's dummy ones:
same seed, same shape).

    python benchmarks/chat_model_dir.py llama2-13b-gqa10 /tmp/llama2-13b-gqa10-chat
        [--set num_hidden_layers=1]   # a smaller model of the same width (CPU smoke tests)
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def build(preset: str, out: str, overrides: dict[str, int] | None = None) -> Path:
    from pensieve.models.demo import TOKENIZER_DIR
    from pensieve.models.presets import make_dummy_config

    cfg = make_dummy_config(preset)
    for k, v in (overrides or {}).items():
        if not hasattr(cfg, k):
            raise SystemExit(f"{preset}: the config has no {k!r}")
        setattr(cfg, k, v)
    vocab = int(getattr(cfg, "vocab_size", 0) or 0)
    if vocab < 32000:
        raise SystemExit(f"{preset}: vocabulary {vocab} < 32000, the demo tokenizer's")
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(d)
    for f in TOKENIZER_DIR.iterdir():
        shutil.copy(f, d / f.name)
    return d


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("preset")
    ap.add_argument("out")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=INT",
                    help="override an integer config field (e.g. num_hidden_layers=1)")
    args = ap.parse_args(argv)
    overrides = {k: int(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    print(build(args.preset, args.out, overrides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
