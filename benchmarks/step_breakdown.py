"""Where the time of steps with prefill goes, from a server's own step log.

``pensieve serve`` with ``PENSIEVE_STEP_LOG=path`` writes every engine step as a JSON line
(``churn_points.sh`` sets it and saves ``steps.jsonl.gz`` in ``churn.tgz``). This splits the
steps with prefill into classes and prints, per class: steps, prefill tokens a step, the mean
step (executor) time, the runner's host prepare and issue times, the chunks swapped in by the
step itself and copied ahead for the next, and the cost *net* of the step's decodes (the step's
time less the mean decode-only step, per computed prefill token: what
``benchmarks/step_totals.py`` reports for all of them together), with each class's share of
the prefill tokens and of that net time. Classes: replayed from a CUDA graph or eager; with or
without swap-ins of its own; by prefill tokens a step. Then the small steps with prefill (under
64 tokens) by how many chunks the step before them copied ahead (``swap_in_ahead``, which the
step waits for): what they cost over a decode step, and from those the rate the copies ahead
moved at in serving (:func:`ahead_rate`), and the same small steps by the KV positions their
prefill ranges attend over, with or without copies ahead before them (:func:`small_by_kv`:
the turns admitted with copies ahead are those with long histories). ``--plot`` draws the
net cost per token against the step's prefill tokens::

    python benchmarks/step_breakdown.py \
        A/churn.tgz \
        --plot step_breakdown.png --json step_breakdown.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import tarfile
from pathlib import Path
from typing import Any

TOKEN_BINS = (1, 64, 128, 256, 512, 1024, 4096)
AHEAD_BINS = (0, 1, 64, 128, 256)
KV_BINS = (0, 1000, 2000, 4000, 8000)
"""Bins of the KV positions a small step's prefill ranges attend over (``prefill_kv``)."""
SMALL = 64
"""Steps with fewer prefill tokens than this are "small": their compute is a small part of
what they cost over a decode step, so what they wait for shows."""


def load_rows(path: str) -> list[dict[str, Any]]:
    """The step rows of a ``steps.jsonl(.gz)`` or of the first ``steps.jsonl.gz`` in a
    ``churn.tgz``."""
    p = Path(path)
    if p.suffix in (".tgz", ".gz") and tarfile.is_tarfile(p):
        with tarfile.open(p) as tar:
            member = next((m for m in tar.getmembers()
                           if m.name.rsplit("/", 1)[-1] == "steps.jsonl.gz"), None)
            if member is None:
                raise SystemExit(f"{path}: no steps.jsonl.gz (a server run with "
                                 "PENSIEVE_STEP_LOG, churn_points.sh saves it)")
            f = tar.extractfile(member)
            assert f is not None
            text = gzip.decompress(f.read()).decode()
    else:
        opener = gzip.open if p.suffix == ".gz" else open
        with opener(p, "rt") as fh:
            text = fh.read()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not rows or "prefill_tokens" not in rows[0]:
        raise SystemExit(f"{path}: not a server step log (StepRecord rows)")
    return rows


def ahead_rate(rows: list[dict[str, Any]], base_s: float, chunk_bytes: float,
               min_chunks: int = 32) -> dict[str, Any]:
    """The rate the copies ahead moved at, implied by the small steps after them: a step of
    fewer than :data:`SMALL` prefill tokens after one that copied at least ``min_chunks``
    ahead waits ``w`` = its time over a decode step beyond what such steps cost after none
    (``base_s``); the in stream then took (the step before's time less its host prepare) + w
    for that step's own swap-ins and its copies ahead: ``chunks x chunk_bytes`` over that."""
    rates = []
    for p, r in zip(rows, rows[1:]):
        if 0 < r["prefill_tokens"] < SMALL and p.get("swap_in_ahead", 0) >= min_chunks:
            wait = max(0.0, r["execute_s"] - base_s)
            took = p["execute_s"] - p.get("host_prepare_s", 0.0) + wait
            chunks = p["swap_in_ahead"] + p.get("swap_in_step", 0)
            if took > 0:
                rates.append(chunks * chunk_bytes / took / 1e9)
    if not rates:
        return {"pairs": 0}
    q = statistics.quantiles(rates, n=4) if len(rates) > 1 else [rates[0]] * 3
    return {"pairs": len(rates), "gbps_p25": q[0], "gbps_median": q[1], "gbps_p75": q[2]}


def small_by_kv(rows: list[dict[str, Any]], base: float) -> list[dict[str, Any]]:
    """The small steps with prefill by the KV positions their prefill ranges attend over
    (``prefill_kv``), split by whether the step before copied anything ahead: what they cost
    over a decode step. The turns admitted with copies ahead are the ones with long
    histories, so the two causes of their cost (the copies, the attention over the history)
    come together; the steps with long histories and no copies before them tell them apart."""
    out = []
    edges = [*KV_BINS, None]
    for lo, hi in zip(edges[:-1], edges[1:]):
        for ahead in (False, True):
            extra = [(r["execute_s"] - base) * 1e3 for p, r in zip(rows, rows[1:])
                     if 0 < r["prefill_tokens"] < SMALL
                     and lo <= r.get("prefill_kv", 0)
                     and (hi is None or r.get("prefill_kv", 0) < hi)
                     and (p.get("swap_in_ahead", 0) > 0) == ahead]
            out.append({"prefill_kv": f"{lo}-{hi - 1}" if hi else f">= {lo}",
                        "ahead_before": ahead, "steps": len(extra),
                        "extra_ms_mean": statistics.fmean(extra) if extra else None,
                        "extra_ms_median": statistics.median(extra) if extra else None})
    return out


def summarize(rows: list[dict[str, Any]], chunk_bytes: float = 0.0) -> dict[str, Any]:
    """Per class of steps with prefill: counts, means and the net cost per prefill token;
    the small steps by the copies ahead before them; with ``chunk_bytes``, the rate the
    copies ahead moved at (:func:`ahead_rate`)."""
    decode = [r["execute_s"] for r in rows if r["prefill_tokens"] == 0]
    if not decode:
        raise SystemExit("no decode-only steps: the net cost needs their mean")
    base = statistics.fmean(decode)
    prefill = [r for r in rows if r["prefill_tokens"] > 0]
    all_tokens = sum(r["prefill_tokens"] for r in prefill) or 1
    all_net = sum(r["execute_s"] - base for r in prefill) or 1.0

    def row(name: str, sel: list[dict[str, Any]]) -> dict[str, Any]:
        if not sel:
            return {"class": name, "steps": 0}
        tokens = sum(r["prefill_tokens"] for r in sel)
        net = sum(r["execute_s"] - base for r in sel)

        def mean(key: str) -> float:
            return statistics.fmean(r.get(key, 0) for r in sel)

        return {"class": name, "steps": len(sel), "tokens_per_step": tokens / len(sel),
                "step_ms": mean("execute_s") * 1e3, "prepare_ms": mean("host_prepare_s") * 1e3,
                "issue_ms": mean("host_issue_s") * 1e3, "swap_in_step": mean("swap_in_step"),
                "swap_in_ahead": mean("swap_in_ahead"), "decodes": mean("decode_tokens"),
                "net_us_per_token": net / tokens * 1e6, "token_share": tokens / all_tokens,
                "net_share": net / all_net}

    classes = [row("all steps with prefill", prefill),
               row("graph", [r for r in prefill if r["graph_replay"]]),
               row("eager", [r for r in prefill if not r["graph_replay"]]),
               row("graph, own swap-ins", [r for r in prefill if r["graph_replay"]
                                           and r.get("swap_in_step", 0) > 0]),
               row("graph, none of its own", [r for r in prefill if r["graph_replay"]
                                              and r.get("swap_in_step", 0) == 0])]
    edges = [*TOKEN_BINS, None]
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = [r for r in prefill if r["prefill_tokens"] >= lo
               and (hi is None or r["prefill_tokens"] < hi)]
        classes.append(row(f"{lo}-{hi - 1} tokens" if hi else f">= {lo} tokens", sel))
    after = []  # small steps with prefill by the previous step's chunks copied ahead
    edges2 = [*AHEAD_BINS, None]
    for lo, hi in zip(edges2[:-1], edges2[1:]):
        small = [r for p, r in zip(rows, rows[1:])
                 if 0 < r["prefill_tokens"] < SMALL and p.get("swap_in_ahead", 0) >= lo
                 and (hi is None or p.get("swap_in_ahead", 0) < hi)]
        extra = [(r["execute_s"] - base) * 1e3 for r in small]
        kv = [r.get("prefill_kv", 0) for r in small]
        name = str(lo) if hi == lo + 1 else (f"{lo}-{hi - 1}" if hi else f">= {lo}")
        after.append({"prev_ahead": name, "steps": len(extra),
                      "extra_ms_mean": statistics.fmean(extra) if extra else None,
                      "extra_ms_median": statistics.median(extra) if extra else None,
                      "prefill_kv_mean": statistics.fmean(kv) if kv else None})
    by_kv = small_by_kv(rows, base)
    none_before = after[0]["extra_ms_mean"]
    rate = (ahead_rate(rows, base + none_before / 1e3, chunk_bytes)
            if chunk_bytes and none_before is not None else None)
    return {"decode_step_ms": base * 1e3, "decode_steps": len(decode), "classes": classes,
            "small_after_ahead": after, "small_by_kv": by_kv, "ahead_rate": rate,
            "points": [(r["prefill_tokens"], (r["execute_s"] - base) * 1e3,
                        bool(r["graph_replay"])) for r in prefill]}


def table(s: dict[str, Any]) -> str:
    cols = [("steps", "steps", "{:>6}"), ("tokens_per_step", "tok/step", "{:>8.1f}"),
            ("step_ms", "step ms", "{:>8.2f}"), ("prepare_ms", "prep ms", "{:>8.2f}"),
            ("issue_ms", "issue ms", "{:>8.2f}"), ("swap_in_step", "swap-in", "{:>8.1f}"),
            ("swap_in_ahead", "ahead", "{:>8.1f}"), ("decodes", "decodes", "{:>8.1f}"),
            ("net_us_per_token", "us/tok net", "{:>10.1f}"),
            ("token_share", "tokens", "{:>7.1%}"), ("net_share", "net time", "{:>8.1%}")]
    width = [len(f.format(0)) for _, _, f in cols]
    out = [f"decode-only steps: {s['decode_steps']}, mean {s['decode_step_ms']:.2f} ms",
           f"{'class':<24} " + " ".join(f"{h:>{w}}" for (_, h, _), w in zip(cols, width))]
    for c in s["classes"]:
        if not c["steps"]:
            out.append(f"{c['class']:<24} {0:>6}")
            continue
        out.append(f"{c['class']:<24} " + " ".join(f.format(c[k]) for k, _, f in cols))
    out += ["", f"steps with 1-{SMALL - 1} prefill tokens, by the chunks the step before copied "
            "ahead: ms over the mean decode step",
            f"{'chunks ahead before':<24} {'steps':>6} {'mean':>8} {'median':>8} {'KV':>8}"]
    for a in s["small_after_ahead"]:
        cells = (f"{a['extra_ms_mean']:>8.2f} {a['extra_ms_median']:>8.2f} "
                 f"{a['prefill_kv_mean']:>8.0f}" if a["steps"] else f"{'-':>8} {'-':>8} {'-':>8}")
        out.append(f"{a['prev_ahead']:<24} {a['steps']:>6} {cells}")
    out += ["(KV: mean positions the step's prefill ranges attend over)", "",
            "the same steps by those positions, with or without copies ahead before them",
            f"{'prefill KV':<14} {'ahead before':<13} {'steps':>6} {'mean':>8} {'median':>8}"]
    for a in s.get("small_by_kv", []):
        if a["steps"]:
            out.append(f"{a['prefill_kv']:<14} {'yes' if a['ahead_before'] else 'no':<13} "
                       f"{a['steps']:>6} {a['extra_ms_mean']:>8.2f} {a['extra_ms_median']:>8.2f}")
    r = s.get("ahead_rate")
    if r and r["pairs"]:
        out += ["", f"copies ahead (>= 32 chunks) before a small step, implied in-stream rate: "
                f"median {r['gbps_median']:.1f} GB/s (quartiles {r['gbps_p25']:.1f}-"
                f"{r['gbps_p75']:.1f}) over {r['pairs']} pairs"]
    return "\n".join(out)


def plot(s: dict[str, Any], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for graph, label, color in ((True, "replayed from a graph", "tab:blue"),
                                (False, "eager", "tab:orange")):
        pts = [(t, ms / t * 1e3) for t, ms, g in s["points"] if g == graph]
        if pts:
            ax.scatter(*zip(*pts), s=6, alpha=0.4, color=color, label=label)
    ax.set_xscale("log")
    ax.set_ylim(-50, 400)
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("prefill tokens of the step")
    ax.set_ylabel("step time less the mean decode step,\nper prefill token (us)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", help="steps.jsonl(.gz) of a server, or a churn.tgz holding one")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--chunk-mb", type=float, default=6.55,
                    help="MB of one chunk, all layers, K and V (default: Llama 2-13B GQA-10, "
                         "32 tokens, bf16), for the copies' implied rate; 0: not computed")
    args = ap.parse_args(argv)
    s = summarize(load_rows(args.log), args.chunk_mb * 1e6)
    print(table(s))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: v for k, v in s.items() if k != "points"}, f, indent=1)
    if args.plot:
        plot(s, args.plot, f"steps with prefill: {args.log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
