"""The docs' tables and plot from one ``scripts/gpu_acceptance.sh`` output directory.

    python scripts/gpu_acceptance_docs.py OUT_DIR [--plot docs/results/acceptance/NAME.png]
        [--md PATH] [--update-doc docs/benchmarks.md]
    python scripts/gpu_acceptance_docs.py --merge-attention OUT.json IN.json ...

Reads what the script leaves in ``OUT_DIR`` (each file optional; a stage that did not run has
no section):

- ``acceptance.txt``: the ``card:`` and ``commit:`` lines and one ``stage NAME rc=.. s=..``
  line per stage;
- ``gpu_tests.txt``: pytest's output (its last ``passed`` / ``failed`` summary line);
- ``long_attention.json``: ``benchmarks/long_attention.py --cuda-graphs`` (``rows`` of
  ``context``, ``query_len``, ``batch``, ``sdpa[_graph]_s``, ``ours_{bf16,fp8}[_graph]_s``);
- ``points.jsonl``: the agent points (``pensieve.bench.multiturn`` rows: ``tag``,
  ``conv_rate``, ``ttft_s_p50`` / ``_p90``, the context's sources, ``steady_state``);
- ``step_totals.json``: ``benchmarks/step_totals.py --json`` (server -> costs).

Writes the markdown (stdout, ``--md``, or between the ``<!-- gpu-acceptance:start -->`` and
``<!-- gpu-acceptance:end -->`` lines of ``--update-doc``) and one small PNG (``--plot``):
ours / SDPA by context for prefill and decode (CUDA-graph replays, bf16 and FP8 KV) beside the
agent points' P50 / P90 TTFT. Every table names the card.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

START, END = "<!-- gpu-acceptance:start -->", "<!-- gpu-acceptance:end -->"


def read_meta(out: Path) -> dict[str, Any]:
    """``card``, ``commit`` and ``stages`` ([(name, rc, seconds)]) from acceptance.txt."""
    meta: dict[str, Any] = {"card": "unknown card", "commit": "unknown", "stages": []}
    p = out / "acceptance.txt"
    if not p.exists():
        return meta
    for line in p.read_text().splitlines():
        if line.startswith("card: "):
            meta["card"] = line[len("card: "):].strip()
        elif line.startswith("commit: "):
            meta["commit"] = line.split()[1]
        m = re.match(r"^stage (.+) rc=(\S+) s=(\d+)$", line)
        if m:
            meta["stages"].append((m.group(1), m.group(2), int(m.group(3))))
    return meta


def card_name(meta: dict[str, Any]) -> str:
    """The GPU's name alone (nvidia-smi's first CSV field)."""
    return str(meta["card"]).split(",")[0].strip()


def tests_line(out: Path) -> str | None:
    """pytest's last summary line (``N passed ... in S s``), or None."""
    p = out / "gpu_tests.txt"
    if not p.exists():
        return None
    lines = [ln.strip("= \n") for ln in p.read_text().splitlines()
             if re.search(r"\d+ (passed|failed|errors?|skipped|deselected)\b", ln)]
    return lines[-1] if lines else "no pytest summary (cut off?)"


def _ms(v: Any) -> str:
    return f"{1e3 * v:.3f}" if isinstance(v, (int, float)) else "-"


def _x(v: Any) -> str:
    return f"{v:.2f}x" if isinstance(v, (int, float)) else "-"


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def attention_table(rows: list[dict[str, Any]], card: str) -> list[str]:
    """One markdown row per case: SDPA and ours in ms (graph replays where timed, else eager),
    ours / SDPA for bf16 and FP8, FP8 / bf16, and the FP8 prefill with e4m3 operands in both
    products (``fp8dot``) over bf16 where it was timed."""
    out = [f"Attention, llama3.1-8b shape, {card} (ms; CUDA-graph replays where timed):", "",
           "| context | case | SDPA | ours bf16 | ours FP8 | bf16 / SDPA | FP8 / SDPA "
           "| FP8 / bf16 | FP8 e4m3 dots / bf16 |",
           "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        g = "_graph" if "sdpa_graph_s" in r else ""
        sdpa, bf, fp = r.get(f"sdpa{g}_s"), r.get(f"ours_bf16{g}_s"), r.get(f"ours_fp8{g}_s")
        dot = r.get(f"ours_fp8dot{g}_s")
        case = (f"prefill {r['query_len']}" if r["query_len"] > 1 else f"decode x{r['batch']}")
        out.append(f"| {r['context'] // 1024}k | {case} | {_ms(sdpa)} | {_ms(bf)} | {_ms(fp)} | "
                   f"{_x(_ratio(bf, sdpa))} | {_x(_ratio(fp, sdpa))} | {_x(_ratio(fp, bf))} | "
                   f"{_x(_ratio(dot, bf))} |")
    return out


def merge_attention(paths: list[Path]) -> dict[str, Any] | None:
    """``long_attention.py`` JSONs of separate runs as one (the first one's header): rows in
    order, the ``fp8dot`` fields of a run of that alone folded into the matching row
    (context, query_len, batch) of another. None without any."""
    docs = [json.loads(p.read_text()) for p in paths if p.exists()]
    if not docs:
        return None
    rows = [r for d in docs for r in d["rows"] if "ours_bf16_s" in r or "ours_fp8_s" in r]
    for d in docs:
        for r in d["rows"]:
            if r in rows:
                continue
            key = (r["context"], r["query_len"], r["batch"])
            same = [x for x in rows if (x["context"], x["query_len"], x["batch"]) == key]
            if same:
                same[0].update({k: v for k, v in r.items() if "fp8dot" in k})
            else:
                rows.append(r)
    return {**docs[0], "rows": rows}


def point_label(p: dict[str, Any]) -> str:
    return f"{p.get('tag') or p.get('system')} @ {p.get('conv_rate')}"


def agent_table(points: list[dict[str, Any]], card: str) -> list[str]:
    """One markdown row per serving point, as docs/long_context.md's agent tables."""
    model = points[0].get("model", "llama3.1-8b") if points else "llama3.1-8b"
    out = [f"Coding-agent load over HTTP, {model} shape, {card}:", "",
           "| point (sessions/s) | window s (requests) | req/s | TTFT P50 / P90 s "
           "| ms per output token P50 / P90 | context from GPU / CPU / recomputed / new "
           "| prefill computed per turn | steady |",
           "| --- | --- | ---: | --- | --- | --- | ---: | --- |"]
    for p in points:
        n = p.get("requests") or 0
        per_turn = p.get("prefill_computed_tokens", 0) / n if n else 0.0
        src = " / ".join(f"{p.get(k, 0.0):.2f}" for k in
                         ("gpu_hit_rate", "cpu_hit_rate", "recomputed_rate", "new_prompt_rate"))
        w0 = p.get("warmup_s", 0.0)
        steady = "yes" if p.get("steady_state") else "no"
        unsteady = (p.get("steady") or {}).get("unsteady") or []
        if unsteady:
            steady += ": " + ", ".join(unsteady)
        out.append(
            f"| {point_label(p)} | {w0:.0f}-{p.get('duration_s', 0.0):.0f} ({n}) "
            f"| {p.get('throughput_rps', 0.0):.2f} "
            f"| {p.get('ttft_s_p50', 0.0):.2f} / {p.get('ttft_s_p90', 0.0):.2f} "
            f"| {1e3 * p.get('normalized_latency_s_p50', 0.0):.0f} / "
            f"{1e3 * p.get('normalized_latency_s_p90', 0.0):.0f} | {src} | {per_turn:,.0f} "
            f"| {steady} |")
    return out


def steps_table(totals: dict[str, dict[str, float]], card: str) -> list[str]:
    """The servers' own step accounting (benchmarks/step_totals.py), one row per server (its
    ``/metrics`` counters where it saved them, else its step log)."""
    out = [f"Server step totals, {card} (`benchmarks/step_totals.py`, whole runs):", "",
           "| server | us / prefill token (net of decodes) | prefill step ms (host prepare) "
           "| decode step ms (host prepare) | scheduler ms / step | prefill graph share |",
           "| --- | ---: | ---: | ---: | ---: | ---: |"]
    servers = {n.rsplit("/", 1)[0] for n in totals if n.endswith("metrics_end.txt")}
    for name, c in totals.items():
        if name.rsplit("/", 1)[0] in servers and not name.endswith("metrics_end.txt"):
            continue  # the server's own counters stand for its step log
        out.append(
            f"| {name} | {c['us_per_prefill_token']:.1f} ({c['us_per_prefill_token_net']:.1f}) "
            f"| {c['prefill_step_ms']:.1f} ({c.get('prefill_host_prepare_ms', 0.0):.1f}) "
            f"| {c['decode_step_ms']:.1f} ({c.get('decode_host_prepare_ms', 0.0):.2f}) "
            f"| {c['scheduler_ms_per_step']:.3f} | {c.get('prefill_graph_share', 0.0):.2f} |")
    return out


def load(out: Path) -> dict[str, Any]:
    """Everything the output directory holds, parsed; absent parts are None."""
    att = out / "long_attention.json"
    pts = out / "points.jsonl"
    st = out / "step_totals.json"
    return {
        "meta": read_meta(out),
        "tests": tests_line(out),
        "attention": json.loads(att.read_text())["rows"] if att.exists() else None,
        "points": [json.loads(ln) for ln in pts.read_text().splitlines() if ln.strip()]
        if pts.exists() else None,
        "steps": json.loads(st.read_text()) if st.exists() else None,
    }


def markdown(d: dict[str, Any], plot: str | None = None) -> str:
    """The whole section: the card and commit, the stages, then one table per result."""
    meta = d["meta"]
    card = card_name(meta)
    lines = [f"`scripts/gpu_acceptance.sh` on {meta['card']} at `{meta['commit']}`.", ""]
    if meta["stages"]:
        lines += ["| stage | exit status | s |", "| --- | --- | ---: |"]
        lines += [f"| {n} | {rc} | {s} |" for n, rc, s in meta["stages"]]
        lines.append("")
    if d["tests"] is not None:
        lines += [f"GPU tests ({card}): {d['tests']}", ""]
    if d["attention"]:
        lines += attention_table(d["attention"], card) + [""]
    if d["points"]:
        lines += agent_table(d["points"], card) + [""]
    if d["steps"]:
        lines += steps_table(d["steps"], card) + [""]
    if plot:
        lines += [f"![GPU acceptance on {card}]({plot})", ""]
    return "\n".join(lines)


def plot(d: dict[str, Any], path: Path) -> bool:
    """Ours / SDPA by context (left) and the agent points' TTFT (right) as one small PNG;
    False when there is nothing to plot."""
    rows, points = d["attention"] or [], d["points"] or []
    if not rows and not points:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=80)
    cases = sorted({(r["query_len"], r["batch"]) for r in rows})
    for q, bsz in cases:
        sel = sorted((r for r in rows if (r["query_len"], r["batch"]) == (q, bsz)),
                     key=lambda r: r["context"])
        name = f"prefill {q}" if q > 1 else f"decode x{bsz}"
        for kv, style in (("bf16", "-o"), ("fp8", "--s")):
            g = "_graph" if "sdpa_graph_s" in sel[0] else ""
            xs = [r["context"] // 1024 for r in sel if r.get(f"ours_{kv}{g}_s")]
            ys = [r[f"ours_{kv}{g}_s"] / r[f"sdpa{g}_s"] for r in sel if r.get(f"ours_{kv}{g}_s")]
            if xs:
                a.plot(xs, ys, style, ms=4, label=f"{name} {kv}")
    a.axhline(1.0, color="k", lw=0.8)
    a.set_xscale("log", base=2)
    a.set_xlabel("context (k tokens)")
    a.set_ylabel("ours / SDPA")
    a.set_title("attention", fontsize=10)
    if rows:
        a.legend(fontsize=6, ncol=2)
    labels = [point_label(p) for p in points]
    xs = range(len(points))
    b.bar([x - 0.2 for x in xs], [p.get("ttft_s_p50", 0.0) for p in points], 0.4, label="P50")
    b.bar([x + 0.2 for x in xs], [p.get("ttft_s_p90", 0.0) for p in points], 0.4, label="P90")
    b.set_xticks(list(xs), labels, fontsize=7)
    b.set_ylabel("TTFT (s)")
    b.set_title("coding-agent over HTTP", fontsize=10)
    if points:
        b.legend(fontsize=7)
    fig.suptitle(card_name(d["meta"]), fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def update_doc(doc: Path, section: str) -> None:
    """Replace the lines between START and END in ``doc`` (both kept) with ``section``;
    raises ValueError when the markers are missing."""
    text = doc.read_text()
    i, j = text.find(START), text.find(END)
    if i < 0 or j < i:
        raise ValueError(f"{doc} lacks the {START} / {END} lines")
    doc.write_text(text[:i + len(START)] + "\n" + section.rstrip() + "\n" + text[j:])


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--merge-attention"]:  # the acceptance script's: OUT.json IN.json...
        if len(argv) < 2:
            raise SystemExit("--merge-attention OUT.json IN.json ...")
        merged = merge_attention([Path(p) for p in argv[2:]])
        if merged is not None:
            Path(argv[1]).write_text(json.dumps(merged, indent=1))
            print(f"long_attention.json: {len(merged['rows'])} rows")
        return 0
    ap = argparse.ArgumentParser(prog="scripts/gpu_acceptance_docs.py",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path, help="scripts/gpu_acceptance.sh's $OUT")
    ap.add_argument("--plot", type=Path, default=None, help="PNG to write")
    ap.add_argument("--plot-link", default=None,
                    help="the PNG's path as the markdown links it (default: --plot relative "
                         "to docs/)")
    ap.add_argument("--md", type=Path, default=None, help="write the markdown here")
    ap.add_argument("--update-doc", type=Path, default=None,
                    help="replace the gpu-acceptance section of this markdown file")
    a = ap.parse_args(argv)
    d = load(a.out_dir)
    link = None
    if a.plot is not None and plot(d, a.plot):
        link = a.plot_link or (str(a.plot)[len("docs/"):] if str(a.plot).startswith("docs/")
                               else str(a.plot))
    section = markdown(d, link)
    if a.md:
        a.md.write_text(section)
    if a.update_doc:
        update_doc(a.update_doc, section)
    if not a.md and not a.update_doc:
        print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
