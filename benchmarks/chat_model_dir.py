"""A model directory that ``pensieve serve`` can chat with: a preset's shape and a tokenizer.

The presets (``llama2-13b-gqa10``, ...) carry no tokenizer, so a server started on one serves
token ids only and ``/v1/chat/completions`` is off. For an ordinary chat client against
dummy weights of that shape, this writes ``config.json`` of the preset and a tokenizer into a
directory; serve it with ``--load-format dummy`` (the weights are the preset's dummy ones:
same seed, same shape). Tokenizers (``--tokenizer``):

- ``words`` (default): a word-level vocabulary of the preset's size. The load generator's
  chat words (:data:`pensieve.bench.http_wire.CHAT_WORDS`) come first, then fillers ``w0``,
  ``w1``, ...; text splits on whitespace; the demo model's ``[INST]`` template. Any sequence of
  ids decodes to words that encode back to the same ids. Dummy weights emit random ids, and
  with a subword vocabulary their text re-tokenizes differently from the first token on, so
  the server, which keeps a conversation's KV only up to the first token that differs from
  the re-rendered history, would recompute every previous answer. A trained model's answers
  do round-trip (tests/test_server_stop.py), so this keeps the benchmark's token stream like a
  trained model's.
- ``demo``: the demo model's tokenizer (Mistral's 32k SentencePiece vocabulary, the same
  template).

    python benchmarks/chat_model_dir.py llama2-13b-gqa10 /tmp/llama2-13b-gqa10-chat
        [--set num_hidden_layers=1]   # a smaller model of the same width (CPU smoke tests)
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "<<SYS>>", "<</SYS>>")
"""The word-level tokenizer's special tokens: unknown, BOS, EOS and the template's markers."""


def save_words_tokenizer(vocab_size: int, out: Path) -> None:
    """The ``words`` tokenizer (module docstring) of ``vocab_size`` ids, saved into ``out``."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from pensieve.bench.http_wire import CHAT_WORDS
    from pensieve.models.demo import TOKENIZER_DIR

    vocab: dict[str, int] = {}
    for t in (*SPECIAL_TOKENS, *CHAT_WORDS):
        vocab.setdefault(t, len(vocab))
    k = 0
    while len(vocab) < vocab_size:
        vocab.setdefault(f"w{k}", len(vocab))
        k += 1
    if len(vocab) > vocab_size:
        raise SystemExit(f"vocabulary {vocab_size} < the {len(vocab)} chat words and markers")
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)
    fast.chat_template = (TOKENIZER_DIR / "chat_template.jinja").read_text()
    fast.save_pretrained(out)


def build(preset: str, out: str, overrides: dict[str, int] | None = None,
          tokenizer: str = "words") -> Path:
    from pensieve.models.demo import TOKENIZER_DIR
    from pensieve.models.presets import make_dummy_config

    cfg = make_dummy_config(preset)
    for k, v in (overrides or {}).items():
        if not hasattr(cfg, k):
            raise SystemExit(f"{preset}: the config has no {k!r}")
        setattr(cfg, k, v)
    vocab = int(getattr(cfg, "vocab_size", 0) or 0)
    if tokenizer == "demo" and vocab < 32000:
        raise SystemExit(f"{preset}: vocabulary {vocab} < 32000, the demo tokenizer's")
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(d)
    if tokenizer == "words":
        save_words_tokenizer(vocab, d)
    elif tokenizer == "demo":
        for f in TOKENIZER_DIR.iterdir():
            shutil.copy(f, d / f.name)
    else:
        raise SystemExit(f"unknown tokenizer {tokenizer!r} (words, demo)")
    return d


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("preset")
    ap.add_argument("out")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=INT",
                    help="override an integer config field (e.g. num_hidden_layers=1)")
    ap.add_argument("--tokenizer", choices=["words", "demo"], default="words",
                    help="words: every id sequence re-tokenizes to itself (default); demo: the "
                         "demo model's SentencePiece tokenizer")
    args = ap.parse_args(argv)
    overrides = {k: int(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    print(build(args.preset, args.out, overrides, args.tokenizer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
