"""Figure 12: our paged attention kernel against the alternatives, for one attention layer.

Llama 2-13B GQA shape (40 query heads, 10 KV heads, head_dim 128, bf16), KV cache paged in
32-token blocks whose ids are a random permutation (no request's blocks are contiguous). Every
configuration is a batch of requests, request ``r`` with ``q_len`` new tokens after ``ctx``
cached ones: its query tokens sit at positions ``ctx .. ctx + q_len - 1`` and attend causally
to positions ``0 .. p`` (``ctx + q_len`` KV positions in all). The variants, all computing the
same attention:

    ours  paged_attention_triton over the paged cache, one launch for the whole batch
    a     ideal: KV already contiguous per request, torch SDPA (flash backend where it runs)
    b     copy-then-attend: gather the paged KV into contiguous tensors, then (a); the time
          includes the copy
    c     single-token paged attention: paged_attention_triton once per query index j (one
          one-token range per request at position ctx + j), i.e. q_len launches, as a
          decode-only kernel would be used for prefill
    d     FlexAttention over the paged cache viewed as one flat KV sequence, with a block mask
          built from the block tables (torch.compile'd on CUDA)

Causal masks for SDPA: ``q_len == 1`` needs none; ``ctx == 0`` is the square ``is_causal``;
otherwise the query is offset, and the mask is ``causal_lower_right`` (bottom-right aligned).
PyTorch's flash kernel is bottom-right aligned by nature, and ``causal_lower_right`` runs it when
``can_use_flash_attention`` allows; the first backend that runs, of flash (GQA native), then
efficient (KV heads expanded to 40, outside (a)'s time but inside (b)'s) and math, is used and
recorded per configuration (``backend_a``, ``backend_b``). On the CPU, flash (the CPU kernel)
gets the lower-right mask materialized as a boolean mask.

Mixed batches (decodes beside prefills) run as one launch for ours, (c) and (d); (a) and (b)
are the *sums* of their homogeneous sub-batches' times, each measured separately.

Timing: CUDA events around each variant, ``--warmup`` runs then the median of ``--iters``
(fewer, down to 3, where one run is long: see ``--budget``). Before timing, every variant's
output is compared with ours (max abs error; ``agree_*`` is error <= atol: 2e-2 for bf16).

On CUDA the default is the full grid (query lengths {1, 16, 64, 128, 256, 512} x contexts
{0, 1024, 4096, 16384}, batch from :func:`batch_size`, plus two mixed batches)::

    python benchmarks/kernel_compare.py --out kernel_compare.json --plot kernel_compare.png

``--check`` (the default without CUDA, where the Triton kernels run in Triton's interpreter)
runs tiny shapes (4 query heads, 2 KV heads, head_dim 32, float32) without timing and checks
that every variant agrees with ours (and ours with the float32 reference).
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

# The Triton interpreter must be chosen before the kernels are decorated.
if not torch.cuda.is_available():
    _already = "pensieve.kernels.triton_attention" in sys.modules
    os.environ["TRITON_INTERPRET"] = "1"
    if _already:  # imported earlier without the interpreter: decorate the kernels again
        importlib.reload(sys.modules["pensieve.kernels.triton_attention"])

import argparse
import json
import statistics
import time
import traceback
from collections.abc import Callable

import triton
from kernel_configs import (
    ATOL,
    CHECK_SHAPE,
    DTYPES,
    FULL_SHAPE,
    MIXED_NOTE,
    VARIANT_NAMES,
    VARIANTS,
    Config,
    Problem,
    Shape,
    check_configs,
    grid_configs,
    make_problem,
    select_configs,
)
from kernel_variants import (
    PREPARE,
    Prepared,
    prepare_flex,
)

from pensieve.kernels.reference import paged_attention_ref

# ---------------------------------------------------------------------------------------
# running


def run_once(prep: Prepared, p: Problem) -> torch.Tensor:
    """Every part once; their outputs assembled into ``[T, H, D]``."""
    out = torch.full_like(p.q, float("nan"))
    for part in prep.parts:
        out[part.tokens] = part.collect(part.run())
    return out


def time_part(fn: Callable[[], object], warmup: int, iters: int, budget_s: float) -> float:
    """Median CUDA-event time of ``fn`` in microseconds, after ``warmup`` runs.

    Fewer iterations (at least 3) when ``iters`` runs would take longer than ``budget_s``.
    """
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = time.perf_counter() - t0
    for _ in range(max(0, warmup - 1)):
        fn()
    n = max(3, min(iters, int(budget_s / max(one, 1e-9))))
    times = []
    for _ in range(n):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _short(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def run_config(config: Config, shape: Shape, dtype: torch.dtype, device: str, *, timing: bool,
               warmup: int = 3, iters: int = 10, budget_s: float = 3.0, check_ref: bool = False,
               variants: tuple[str, ...] = VARIANTS, seed: int = 0,
               flex_kv_block: int = 128) -> dict:
    """One configuration: outputs compared with ours, then (``timing``) every part timed."""
    p = make_problem(config, shape, dtype, device, seed=seed)
    atol = ATOL[dtype]
    row: dict = {
        "config": config.name,
        "groups": [{"batch": g.batch, "q_len": g.q_len, "ctx": g.ctx} for g in config.groups],
        "mixed": config.mixed,
        "num_requests": config.num_requests,
        "num_tokens": config.num_tokens,
        "kv_tokens": config.kv_tokens,
        "heads": shape.heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "chunk": shape.chunk, "dtype": str(dtype).removeprefix("torch."), "atol": atol,
    }
    if config.mixed:
        row["note"] = MIXED_NOTE
    ours = None
    for v in variants:
        row[f"{v}_us"] = None
        try:
            prep = prepare_flex(p, flex_kv_block) if v == "d" else PREPARE[v](p)
            out = run_once(prep, p)
            row[f"backend_{v}"] = prep.backend
            if v == "ours":
                ours = out
                if check_ref:
                    ref = paged_attention_ref(
                        p.q, p.k_cache, p.v_cache, p.block_tables, p.query_start_loc,
                        p.range_start_pos, p.range_table, p.scale,
                        out=torch.empty(p.q.shape, device=p.q.device))
                    err = (out.float() - ref).abs().max().item()
                    row["err_ref"] = err
                    row["agree_ref"] = bool(err <= atol)
            elif ours is not None:
                err = (out.float() - ours.float()).abs().max().item()  # NaN if unwritten
                row[f"err_{v}"] = err
                row[f"agree_{v}"] = bool(err <= atol)
            if timing:
                row[f"{v}_us"] = sum(time_part(part.run, warmup, iters, budget_s)
                                     for part in prep.parts)
                if len(prep.parts) > 1:
                    row[f"{v}_parts"] = len(prep.parts)
            del prep, out
        except Exception as e:  # noqa: BLE001 - record why, keep going
            row[f"not_run_{v}"] = "not run: " + _short(e)
            if os.environ.get("KERNEL_COMPARE_TRACEBACK"):
                traceback.print_exc()
            if v == "ours":
                break
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    t = {v: row.get(f"{v}_us") for v in variants}
    if t.get("ours"):
        for v in ("b", "c", "d"):
            if t.get(v):
                row[f"{v}_over_ours"] = t[v] / t["ours"]
        if t.get("a"):
            row["ours_over_a"] = t["ours"] / t["a"]
    del p, ours
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


# ---------------------------------------------------------------------------------------
# output


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _status(row: dict, variants: tuple[str, ...]) -> str:
    bad = [v for v in variants if v != "ours" and row.get(f"agree_{v}") is False]
    if row.get("agree_ref") is False:
        bad.append("ref")
    missing = [v for v in variants if f"not_run_{v}" in row]
    s = "ok" if not bad else "DISAGREE: " + ",".join(bad)
    if missing:
        s += " (not run: " + ",".join(missing) + ")"
    return s


def format_table(rows: list[dict], timing: bool, variants: tuple[str, ...] = VARIANTS) -> str:
    if timing:
        head = ["config", "B", "T", *[f"{v} us" for v in variants],
                "ours/a", "b/ours", "c/ours", "d/ours", "check"]
        body = [[r["config"], str(r["num_requests"]), str(r["num_tokens"]),
                 *[_fmt(r.get(f"{v}_us")) for v in variants],
                 _fmt(r.get("ours_over_a"), ".2f"), _fmt(r.get("b_over_ours"), ".2f"),
                 _fmt(r.get("c_over_ours"), ".2f"), _fmt(r.get("d_over_ours"), ".2f"),
                 _status(r, variants)] for r in rows]
    else:
        errs = [v for v in variants if v != "ours"]
        head = ["config", "B", "T", "err ref", *[f"err {v}" for v in errs], "check"]
        body = [[r["config"], str(r["num_requests"]), str(r["num_tokens"]),
                 _fmt(r.get("err_ref"), ".1e"), *[_fmt(r.get(f"err_{v}"), ".1e") for v in errs],
                 _status(r, variants)] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h)
              for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(
        zip(head, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for b in body:
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w)
                               for i, (c, w) in enumerate(zip(b, widths))))
    notes = []
    for r in rows:
        for v in variants:
            if f"not_run_{v}" in r:
                notes.append(f"{r['config']} {v}: {r[f'not_run_{v}']}")
    backends = sorted({f"{v}: {label}" for r in rows for v in ("a", "b")
                       if f"backend_{v}" in r for label in r[f"backend_{v}"].split(" + ")})
    if backends:
        lines.append("backends (per homogeneous sub-batch):")
        lines += [f"  {b}" for b in backends]
    if any(r.get("mixed") for r in rows) and timing:
        lines.append(MIXED_NOTE)
    lines += notes
    return "\n".join(lines)


def plot(rows: list[dict], path: str, variants: tuple[str, ...] = VARIANTS,
         title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("ours_us")]
    n = len(rows)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.6 * n + 2), 5))
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        xs = [k + (i - (len(variants) - 1) / 2) * width for k in range(n)]
        ys = [r.get(f"{v}_us") or float("nan") for r in rows]
        ax.bar(xs, ys, width, label=VARIANT_NAMES[v])
    ax.set_yscale("log")
    ax.set_ylabel("time per attention layer (us, log)")
    ax.set_xticks(range(n))
    ax.set_xticklabels([f"{r['config']}\nB={r['num_requests']}" for r in rows], rotation=60,
                       ha="right", fontsize=7)
    ax.legend(fontsize=8)
    ax.grid(axis="y", which="both", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def environment(device: str) -> dict:
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (triton interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true",
                    help="tiny shapes, correctness only (the default without CUDA)")
    ap.add_argument("--out", help="write the results as JSON (a list of dicts)")
    ap.add_argument("--plot", help="write a PNG of the times (timing runs only)")
    ap.add_argument("--dtype", choices=sorted(DTYPES),
                    help="default bfloat16, float32 with --check")
    ap.add_argument("--iters", type=int, default=10, help="timed iterations (median)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget", type=float, default=3.0,
                    help="seconds per variant and part: fewer iterations (>= 3) beyond it")
    ap.add_argument("--configs", help="comma-separated fnmatch patterns of config names, e.g. "
                    "'q1_*,mixed*' (names: q<q_len>_ctx<ctx>, mixed_<B>x<q_len>@<ctx>+...)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated subset of " + ",".join(VARIANTS) + " (ours first)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--flex-kv-block", type=int, default=128, choices=(32, 64, 128),
                    help="(d)'s KV block size in slots (32: one page per block, exact sparsity)")
    args = ap.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    check = args.check or device == "cpu"
    dtype = DTYPES[args.dtype or ("float32" if check else "bfloat16")]
    variants = tuple(v for v in VARIANTS if v in args.variants.split(","))
    if "ours" not in variants:
        ap.error("--variants must include ours (everything is compared with it)")
    configs = select_configs(check_configs() if check else grid_configs(), args.configs)
    if not configs:
        ap.error(f"no config matches {args.configs!r}")
    shape = CHECK_SHAPE if check else FULL_SHAPE
    env = environment(device)
    print(f"{env['device']}  torch {env['torch']}  triton {env['triton']}  {dtype}  "
          f"heads {shape.heads}/{shape.kv_heads} x {shape.head_dim}, chunk {shape.chunk}"
          + ("  [check: correctness only]" if check else ""), flush=True)

    try:
        from tqdm import tqdm

        bar = tqdm(configs, desc="configs", file=sys.stderr, dynamic_ncols=True)
    except ImportError:
        bar = configs
    rows = []
    for config in bar:
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(config.name)
        row = run_config(config, shape, dtype, device, timing=not check, warmup=args.warmup,
                         iters=args.iters, budget_s=args.budget, check_ref=check,
                         variants=variants, seed=args.seed, flex_kv_block=args.flex_kv_block)
        row.update(env)
        row["iters"] = args.iters
        row["flex_kv_block"] = args.flex_kv_block
        rows.append(row)
        if args.out:  # after every config, so that a crash keeps what ran
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
    print(format_table(rows, timing=not check, variants=variants))
    if args.plot and not check:
        plot(rows, args.plot, variants, title=f"{env['device']}, {dtype}, "
             f"{shape.heads}/{shape.kv_heads} heads x {shape.head_dim}")
        print(f"plot: {args.plot}")
    if args.out:
        print(f"results: {args.out}")
    failed = [r["config"] for r in rows if _status(r, variants).startswith("DISAGREE")
              or "not_run_ours" in r]
    if failed:
        print("FAILED: " + ", ".join(failed))
    return rows


if __name__ == "__main__":
    rows = main()
    sys.exit(1 if any(_status(r, VARIANTS).startswith("DISAGREE") or "not_run_ours" in r
                      for r in rows) else 0)
