"""The workload data types: :class:`Turn`, :class:`Conversation`, :class:`Workload`, and the
lengths cache (:func:`save_workload` / :func:`load_workload`).

A leaf module: the workload sources (:mod:`pensieve.bench.sharegpt`,
:mod:`pensieve.bench.agentic`, the UltraChat generator and the statistics in
:mod:`pensieve.bench.workload`) build on it, and :mod:`pensieve.bench.workload` re-exports it.
"""

from __future__ import annotations

import gzip
import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_MAX_CONTEXT = 16384
"""Conversations whose total context exceeds this many tokens are left out (the paper's rule)."""

DATA = Path(__file__).resolve().parent / "data"
"""The package's workload files (installed with it)."""
#: The ShareGPT turn lengths cache.
DEFAULT_SHAREGPT_CACHE = DATA / "sharegpt_lengths.json.gz"
#: The same with split pieces joined back into whole conversations (``merge_split=True``).
DEFAULT_SHAREGPT_MERGED_CACHE = DATA / "sharegpt_merged_lengths.json.gz"


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


def draw_sessions(draw: Callable[[random.Random, str, int | None], tuple[Conversation, bool]],
                  num_sessions: int, seed: int, prefix: str,
                  max_context: int | None) -> tuple[list[Conversation], dict[str, int]]:
    """``num_sessions`` conversations ``draw(rng, f"{prefix}-{i}", max_context)`` from one
    generator seeded with ``seed`` (deterministic), and the counts a generated workload
    reports (``drawn``, ``kept``, ``truncated``: cut at ``max_context``)."""
    if num_sessions < 0:
        raise ValueError(f"num_sessions must be >= 0, got {num_sessions}")
    rng = random.Random(seed)
    convs: list[Conversation] = []
    truncated = 0
    for i in range(int(num_sessions)):
        conv, cut = draw(rng, f"{prefix}-{i}", max_context)
        truncated += cut
        convs.append(conv)
    return convs, {"drawn": int(num_sessions), "kept": len(convs), "truncated": truncated}


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
