"""Kernel-level profile of a decode step: where the device time of one step goes.

For each ``BATCHxCTX`` config, a decode step of ``BATCH`` requests at context ``CTX`` (built as
in ``benchmarks/decode_step.py``: dummy weights, distinct random KV blocks, through
``ModelRunner.execute``) is run a few times to warm up, timed without the profiler (``wall``:
median of ``--iters`` steps, each ending with the host's wait for the sampled ids), then
``--steps`` steps are recorded with ``torch.profiler`` (CPU + CUDA activities), eagerly and
replayed from the decode CUDA graphs. Only the graph buckets of the profiled batch sizes are
captured.

Every device event (kernel, memcpy, memset) is put in a category by its name alone
(:func:`categorize`): gemm, attention, kv_store, norm, rotary, elementwise, sampling, memcpy,
other. Per config and mode the script prints, per step: kernel count, GPU µs and share of the
step's wall time per category; the wall time, the sum of kernel time, the gap (wall minus
kernels: launch latency, idle GPU, host work and the final sync), the GPU span (first kernel
start to last kernel end) and the HBM floor ``(weight bytes + batch * (ctx + 1) * KV bytes per
token) / 4.3 TB/s`` (``decode_step.Setup.floor_ms``); the top 15 kernels; the GEMMs' achieved
bandwidth (bytes of the weights the GEMMs read / GEMM time). If CUPTI reports no kernels inside
a graph replay (only the input copies around it), the output says so and gives no gap.

On the H200 (expected under 2 minutes with the default configs: ~20 s model init, ~5 s to
capture the 3 buckets, a few seconds per config and mode)::

    python benchmarks/profile_step.py --model llama2-13b-gqa10 --kv-gb 60 \\
        --out profile_step.json --plot profile_step.png --trace trace.json.gz

``--trace`` writes a gzipped chrome trace (chrome://tracing, https://ui.perfetto.dev) of one
config and mode (``--trace-config``, ``--trace-mode``). Without CUDA (tests, tiny models such as
``--model llama-tiny``) the same script profiles CPU operators instead of kernels: each
``aten::`` op's self CPU time is categorised the same way (the attention then runs as the
pure-torch reference, so its time lands in other categories), and the "graph" mode runs the
static-buffer decode path uncaptured (``DecodeGraphs(capture=False)``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from decode_step import HBM_TBPS, Setup, decode_step, setup
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from pensieve.core.outputs import SchedulerOutput
from pensieve.runner.cuda_graph import DecodeGraphs
from pensieve.runner.model_runner import ModelRunner

DEFAULT_CONFIGS = "1x512,32x512,64x2048,32x8192"
STEP_LABEL = "pensieve_decode_step"
TOP_KERNELS = 15

CATEGORIES = ("gemm", "attention", "kv_store", "norm", "rotary", "elementwise", "sampling",
              "memcpy", "other")
# First match wins, on the lower-cased name. The order matters: cutlass GEMM names contain
# "transforms" (-> "rms"), the argmax and mean reductions are ``reduce_kernel``s, the unfused
# RMSNorm's pow is a ``vectorized_elementwise_kernel``.
_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (cat, re.compile("|".join(pats))) for cat, pats in (
        ("memcpy", [r"^memcpy", r"^memset", r"memcpy[ _]?(htod|dtoh|dtod|htoh|peer)"]),
        ("attention", [r"paged_attention", r"combine_splits", r"flash_fwd", r"fmha",
                       r"attention"]),
        ("kv_store", [r"store_kv", r"reshape_and_cache"]),
        ("sampling", [r"argmax", r"argmin", r"topk", r"radixsort", r"aten::sort", r"multinomial",
                      r"exponential"]),
        ("gemm", [r"gemm", r"cutlass", r"cublas", r"xmma", r"nvjet", r"wgmma", r"splitkreduce",
                  r"^sm\d+_", r"aten::(mm|addmm|bmm|matmul|linear)$"]),
        ("norm", [r"rms", r"layer_?norm", r"meanops", r"pow_tensor_scalar", r"rsqrt",
                  r"aten::(mean|pow)$"]),
        ("rotary", [r"rotary", r"(^|[^a-z])rope"]),
        ("elementwise", [r"elementwise", r"reduce_kernel", r"(^|[^a-z])cat", r"copy",
                         r"silu", r"gelu", r"index", r"fill", r"gather", r"scatter",
                         r"embedding", r"triton_(poi|red|per)_",
                         r"aten::(add|mul|sub|div|neg|exp|where|clamp|sum|relu|to|contiguous)"
                         r"_?$"]),
    )
)


def categorize(name: str) -> str:
    """The category (one of :data:`CATEGORIES`) of a kernel or operator name."""
    low = name.lower()
    for cat, pat in _RULES:
        if pat.search(low):
            return cat
    return "other"


def aggregate(records: Iterable[tuple[str, float]], steps: int,
              top: int = TOP_KERNELS) -> dict[str, Any]:
    """Per-step totals of ``(name, µs)`` records: per category count, µs and share of the
    kernel sum; the sum (``kernel_us``, the sum of the rounded categories); the ``top`` names
    by time."""
    cat_n: dict[str, int] = defaultdict(int)
    cat_us: dict[str, float] = defaultdict(float)
    names: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, us in records:
        cat = categorize(name)
        cat_n[cat] += 1
        cat_us[cat] += us
        names[name][0] += 1
        names[name][1] += us
    cats = {c: {"count": round(cat_n[c] / steps, 2), "us": round(cat_us[c] / steps, 3)}
            for c in CATEGORIES}
    total = round(sum(v["us"] for v in cats.values()), 3)
    for v in cats.values():
        v["share_of_kernels"] = round(v["us"] / total, 4) if total > 0 else 0.0
    ranked = sorted(names.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "categories": cats,
        "kernel_us": total,
        "kernel_count": round(sum(cat_n.values()) / steps, 2),
        "top_kernels": [{"name": n, "category": categorize(n), "count": round(c / steps, 2),
                         "us": round(us / steps, 3)} for n, (c, us) in ranked],
    }


def _activity(e: Any) -> str:
    return str(getattr(e, "activity_type", "") or "")


_NOT_DEVICE_WORK = {"gpu_user_annotation", "user_annotation", "cuda_sync", "overhead"}


def summarise(events: Sequence[Any], steps: int, on_device: bool) -> dict[str, Any]:
    """Aggregate the profiler's events (``prof.events()``) of ``steps`` steps, each inside a
    ``record_function(STEP_LABEL)``: device events on CUDA, operator self times on the CPU."""
    ranges = sorted((e.time_range.start, e.time_range.end) for e in events
                    if e.name == STEP_LABEL and e.device_type == DeviceType.CPU)
    out: dict[str, Any] = {}
    if ranges:
        out["profiled_wall_us"] = round(statistics.median(b - a for a, b in ranges), 3)
    if on_device:
        dev = [e for e in events if e.device_type == DeviceType.CUDA
               and not e.is_user_annotation and _activity(e) not in _NOT_DEVICE_WORK
               and e.name != STEP_LABEL]
        records = [(e.name, e.time_range.end - e.time_range.start) for e in dev]
        spans = []
        for a, b in ranges:  # kineto puts device timestamps on the host's clock
            inside = [e.time_range for e in dev if a <= e.time_range.start <= b]
            if inside:
                spans.append(max(r.end for r in inside) - min(r.start for r in inside))
        if len(spans) == len(ranges) and spans:
            out["gpu_span_us"] = round(statistics.median(spans), 3)
    else:
        ops = [e for e in events if e.device_type == DeviceType.CPU and not e.is_user_annotation
               and _activity(e) in ("cpu_op", "")]
        records = [(e.name, float(e.self_cpu_time_total)) for e in ops]
    out.update(aggregate(records, steps))
    out["kernels_reported"] = any(categorize(n) != "memcpy" for n, _ in records)
    return out


def gemm_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights the GEMMs read: every ``nn.Linear`` and, for a tied LM head, the
    token embedding."""
    seen: set[int] = set()
    total = 0
    out_features = set()
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            out_features.add(m.out_features)
            for p in (m.weight, m.bias):
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel() * p.element_size()
    embeds = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    if embeds:
        tok = max(embeds, key=lambda m: m.num_embeddings)
        if tok.num_embeddings not in out_features and id(tok.weight) not in seen:
            total += tok.weight.numel() * tok.weight.element_size()
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_mode(runner: ModelRunner, sched: SchedulerOutput, args: argparse.Namespace,
                 trace: str | None) -> dict[str, Any]:
    """Warm up, time ``args.iters`` steps, profile ``args.steps`` steps; the summary."""
    device = runner.device
    for _ in range(args.warmup):
        runner.execute(sched)
    walls = []
    for _ in range(args.iters):
        _sync(device)
        t = time.perf_counter()
        runner.execute(sched)  # ends with the host waiting for the sampled ids
        walls.append(time.perf_counter() - t)
    acts = [ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    _sync(device)
    with profile(activities=acts) as prof:
        for _ in range(args.steps):
            with record_function(STEP_LABEL):
                runner.execute(sched)
        _sync(device)
    if trace:
        export_trace(prof, trace)
    res: dict[str, Any] = {"unprofiled_wall_us": round(statistics.median(walls) * 1e6, 3)}
    res.update(summarise(list(prof.events()), args.steps, device.type == "cuda"))
    # Kernel durations do not change under the profiler, the host's time does: on CUDA the
    # step's wall is the unprofiled one; on the CPU the operators' times are the profiled
    # steps' own, so they are set against the profiled wall.
    res["wall_source"] = "unprofiled" if device.type == "cuda" else "profiled"
    res["wall_us"] = res[f"{res['wall_source']}_wall_us"]
    return res


def export_trace(prof: profile, path: str) -> None:
    """Chrome trace of ``prof``, gzipped when ``path`` ends in ``.gz``."""
    if not path.endswith(".gz"):
        prof.export_chrome_trace(path)
        return
    fd, tmp = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(tmp)
        with open(tmp, "rb") as fin, gzip.open(path, "wb") as fout:
            shutil.copyfileobj(fin, fout)
    finally:
        os.unlink(tmp)


def parse_configs(text: str) -> list[tuple[int, int]]:
    """``"1x512,32x8192"`` -> ``[(1, 512), (32, 8192)]``."""
    out = []
    for item in text.split(","):
        b, c = item.lower().strip().split("x")
        out.append((int(b), int(c)))
    return out


def _ms(us: float | None) -> str:
    return "-" if us is None else f"{us / 1e3:.3f} ms"


def report(row: dict[str, Any], mode: str, gemm_bytes: int, on_device: bool) -> list[str]:
    """Text table of one config and mode; also adds the derived fields to ``row[mode]``."""
    r = row[mode]
    wall, kern = r["wall_us"], r["kernel_us"]
    unit = "GPU" if on_device else "CPU self"
    lines = [f"== batch {row['batch']} x ctx {row['ctx']}, {mode}"
             + ("" if mode == "eager" else f" ({'captured' if row['captured'] else 'uncaptured'})")]
    if on_device and not r["kernels_reported"]:
        r["gap_us"] = None
        note = ("the profiler reported no kernels" + (" inside the CUDA graph replay" if mode
                == "graph" and row["captured"] else "") + " (CUPTI); only "
                f"{r['categories']['memcpy']['count']:g} memcpy/memset per step, so no kernel "
                "breakdown or gap for this mode")
        r["note"] = note
        lines.append("   NOTE: " + note)
    else:
        r["gap_us"] = round(wall - kern, 3)
    other = "profiled" if r["wall_source"] == "unprofiled" else "unprofiled"
    span = f", GPU span {_ms(r.get('gpu_span_us'))}" if on_device else ""
    lines.append(f"   step wall {_ms(wall)} ({other} {_ms(r.get(f'{other}_wall_us'))}), "
                 f"{unit} time {_ms(kern)} = {kern / wall:.1%} of wall, gap {_ms(r['gap_us'])}"
                 f"{span}; HBM floor {_ms(row['floor_us'])} "
                 f"(wall = {wall / row['floor_us']:.2f}x floor)")
    lines.append(f"   {'category':<12} {'count/step':>10} {'us/step':>11} {'% wall':>7} "
                 f"{'% kern':>7}")
    for cat in CATEGORIES:
        c = r["categories"][cat]
        c["share_of_wall"] = round(c["us"] / wall, 4)
        if c["count"]:
            lines.append(f"   {cat:<12} {c['count']:>10g} {c['us']:>11.1f} "
                         f"{c['share_of_wall']:>7.1%} {c['share_of_kernels']:>7.1%}")
    gemm_us = r["categories"]["gemm"]["us"]
    r["gemm_gbps"] = round(gemm_bytes / (gemm_us * 1e-6) / 1e9, 1) if gemm_us > 0 else None
    if r["gemm_gbps"] is not None:
        lines.append(f"   gemm: {gemm_bytes / 1e9:.2f} GB of weights in {gemm_us / 1e3:.3f} ms "
                     f"= {r['gemm_gbps']:.0f} GB/s ({r['gemm_gbps'] / (HBM_TBPS * 1e3):.0%} of "
                     f"{HBM_TBPS} TB/s)")
    lines.append(f"   top {len(r['top_kernels'])}: {'us/step':>9} {'count':>6}  name")
    for k in r["top_kernels"]:
        name = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."
        lines.append(f"   {k['category']:>11} {k['us']:>9.1f} {k['count']:>6g}  {name}")
    return lines


def plot(result: dict[str, Any], path: str) -> None:
    """Stacked bars of category time per config and mode, next to the wall time and floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(row, mode) for row in result["configs"] if "skipped" not in row
            for mode in result["modes"] if mode in row]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(bars) + 2), 5))
    xs = range(len(bars))
    bottom = [0.0] * len(bars)
    colors = plt.get_cmap("tab10")
    for i, cat in enumerate(CATEGORIES):
        ys = [row[mode]["categories"][cat]["us"] / 1e3 for row, mode in bars]
        if any(ys):
            ax.bar(xs, ys, bottom=bottom, color=colors(i), label=cat, width=0.7)
            bottom = [b + y for b, y in zip(bottom, ys)]
    ax.scatter(xs, [row[mode]["wall_us"] / 1e3 for row, mode in bars], marker="_", s=900,
               color="k", label="step wall", zorder=3)
    ax.scatter(xs, [row["floor_us"] / 1e3 for row, _ in bars], marker="_", s=900, color="r",
               label="HBM floor", zorder=3)
    ax.set_xticks(list(xs), [f"{row['batch']}x{row['ctx']}\n{mode}" for row, mode in bars],
                  fontsize=8)
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"{result['model']} {result['dtype']} decode step by kernel category "
                 f"({result['device_name']})")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    """The command line's options."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama2-13b-gqa10")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="BATCHxCTX,... (default "
                    f"{DEFAULT_CONFIGS})")
    ap.add_argument("--kv-gb", type=float, default=60.0, help="KV cache size (GiB); configs "
                    "whose KV does not fit are skipped")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10, help="unprofiled steps timed for the wall")
    ap.add_argument("--steps", type=int, default=5, help="profiled steps")
    ap.add_argument("--no-graphs", action="store_true", help="profile the eager step only")
    ap.add_argument("--out", default=None, help="JSON of everything")
    ap.add_argument("--plot", default=None, help="stacked bar plot (png)")
    ap.add_argument("--trace", default=None, help="chrome trace of one config (.json.gz)")
    ap.add_argument("--trace-config", default=None, help="BATCHxCTX to trace (default: the "
                    "first profiled)")
    ap.add_argument("--trace-mode", default="graph", choices=("eager", "graph"))
    return ap


def build_runners(su: Setup, fitting: list[tuple[int, int]], no_graphs: bool,
                  on_device: bool) -> tuple[dict[str, ModelRunner], bool, float, list[int]]:
    """The eager runner and, unless ``no_graphs``, one replaying decode graphs of the profiled
    batch sizes (captured on CUDA): (runners by mode, captured, capture seconds, buckets)."""
    runners: dict[str, ModelRunner] = {"eager": ModelRunner(su.model, su.layout, su.kv)}
    captured, capture_s, buckets = False, 0.0, []
    if not no_graphs and fitting:
        buckets = sorted({b for b, _ in fitting})
        graphs = DecodeGraphs(su.model, su.kv, su.chunk, max(buckets),
                              su.graph_max_blocks(max(buckets), max(c for _, c in fitting)),
                              capture=False)
        graphs.buckets = buckets  # capture only the profiled batch sizes (each its own bucket)
        if on_device:
            # Profiling graph replays works only if the profiler ran once before the capture
            # (pytorch/pytorch#100441, torch.profiler._utils._init_for_cuda_graphs).
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
                pass
            t0 = time.perf_counter()
            graphs.capture()
            capture_s = time.perf_counter() - t0
            captured = True
            print(f"captured {len(buckets)} graphs {buckets} in {capture_s:.1f} s")
        runner = ModelRunner(su.model, su.layout, su.kv)
        runner.decode_graphs = graphs
        runners["graph"] = runner
    return runners, captured, capture_s, buckets


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)

    device = torch.device(args.device)
    on_device = device.type == "cuda"
    dtype = getattr(torch, args.dtype)
    configs = parse_configs(args.configs)
    t0 = time.perf_counter()
    su: Setup = setup(args.model, dtype, args.kv_gb, device)
    init_s = time.perf_counter() - t0
    gemm_bytes = gemm_weight_bytes(su.model)
    fitting = [(b, c) for b, c in configs if su.fits(b, c)]
    print(f"{args.model} {args.dtype} on {device}: weights {su.weight_bytes / 1e9:.2f} GB "
          f"(GEMMs read {gemm_bytes / 1e9:.2f} GB), {su.num_blocks} KV blocks, "
          f"set up in {init_s:.1f} s")

    runners, captured, capture_s, buckets = build_runners(su, fitting, args.no_graphs,
                                                          on_device)

    trace_cfg = parse_configs(args.trace_config)[0] if args.trace_config else (
        fitting[0] if fitting else None)
    trace_mode = args.trace_mode if args.trace_mode in runners else "eager"
    rng = random.Random(0)
    free = list(range(su.num_blocks))
    rows: list[dict[str, Any]] = []
    for batch, ctx in configs:
        if not su.fits(batch, ctx):
            rows.append({"batch": batch, "ctx": ctx, "skipped": "KV does not fit"})
            print(f"== batch {batch} x ctx {ctx}: skipped, KV does not fit")
            continue
        row: dict[str, Any] = {"batch": batch, "ctx": ctx,
                               "floor_us": round(su.floor_ms(batch, ctx) * 1e3, 3),
                               "captured": captured}
        sched = decode_step(batch, ctx, su.chunk, rng, free)
        for mode, runner in runners.items():
            trace = args.trace if (batch, ctx) == trace_cfg and mode == trace_mode else None
            row[mode] = profile_mode(runner, sched, args, trace)
            if mode == "graph":
                row[mode]["graph_steps"] = runner.num_graph_steps
            print("\n".join(report(row, mode, gemm_bytes, on_device)), flush=True)
            if trace:
                print(f"   chrome trace of this mode: {args.trace}")
        rows.append(row)

    result = {
        "model": args.model, "dtype": args.dtype, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if on_device else "cpu",
        "torch": torch.__version__, "unit": "us per decode step" if on_device else
        "us per decode step (CPU operator self time, not kernels)",
        "weight_gb": round(su.weight_bytes / 1e9, 3), "gemm_weight_gb": round(gemm_bytes / 1e9, 3),
        "kv_bytes_per_token": su.kv_per_token, "hbm_tbps": HBM_TBPS, "init_s": round(init_s, 1),
        "graphs_captured": captured, "graph_buckets": buckets, "capture_s": round(capture_s, 1),
        "warmup": args.warmup, "iters": args.iters, "steps": args.steps,
        "categories": list(CATEGORIES), "modes": list(runners), "configs": rows,
        "trace": args.trace and {"path": args.trace, "config": list(trace_cfg or ()),
                                 "mode": trace_mode},
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
