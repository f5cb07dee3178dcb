"""Swap bandwidth between the GPU tier and the pinned CPU tier, through KVSwapper.

Llama 2-13B GQA-10 shape by default (40 layers, 10 KV heads, head_dim 128, bf16, chunk 32:
80 KB per K or V chunk per layer, 160 KB of K+V, 6.5 MB for all layers). The GPU caches are
the engine's layout (views of one allocation). For each copy method of ``KVSwapper``

    staged   chunk-major CPU tier; swap-in through the copy engines by groups of layers
             (KVSwapper in_groups, default 8): per group one cuMemcpyBatchAsync call into
             a staging buffer, then a device-side scatter; layer i waits for its group.
             Swap-out: device-side gather into staging, one copy per run of consecutive CPU
             ids (>= 6.5 MB, one batch call a piece), pieces of --staging-chunks through two
             halves (the default on CUDA)
    dma      one cudaMemcpy per run of consecutive CPU ids per layer (80 KB pieces)

and each chunk count it times one step moving that many chunks with GPU and CPU block ids
drawn at random (random order, scattered)::

    in       swap_in
    out      background swap_out
    in+out   both in one step, disjoint blocks: on two streams at once (staged),
             DMA on one stream one after the other
    in+out xK   ``--steps`` K such steps back to back, as a serving engine under churn
             issues them: each step waits for its own swap-ins only (``end_step``), its
             background swap-outs run on beside the next steps, and the clock stops once the
             last copy is done. GB/s each way = K steps' bytes of one direction over that
             time; ``step`` is then the median time from a step's ``start_step`` to its
             swap-ins done. The steps' swap-ins and swap-outs never share a block, so no step
             waits for an earlier one's swap-outs (the steps cycle through as many disjoint
             plans as the tiers hold)

Times are host wall clock from ``start_step`` to ``finish_step`` (after a device
synchronize; median of ``--reps`` after a warm-up). ``GB/s`` is per direction (in+out: each
way, i.e. the bytes of one direction over the step's time). ``enqueue`` is the host time of
``start_step``; ``step`` the host time of ``start_step`` + ``end_step`` (what a serving step
waits for: swap-ins yes, background swap-outs no); ``layer0`` the device time until layer 0's
swap-ins are usable by the compute stream. Raw single copies (H2D, D2H, both on two
streams) and the H200's 55 GB/s one-way reference give the ceiling.

``--sweep-programs`` / ``--sweep-tiles`` time the staged method's kernels (gathers, scatters,
urgent swap-outs) per persistent grid size and per tile at ``--sweep-chunks`` chunks, and how
much a bf16 GEMM loop on the compute stream slows down while in+out copies run beside it (``gemm
x``: its time with copies / alone), to pick ``DEFAULT_PROGRAMS`` by measurement.

    python benchmarks/swap_bandwidth.py --out swap_bandwidth.json --plot swap_bandwidth.png
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from collections.abc import Callable

import torch

from pensieve.core.outputs import SwapPlan
from pensieve.engine.kv_layout import KVLayout
from pensieve.kernels.launch_swap import DEFAULT_PROGRAMS, DEFAULT_TILE_BYTES
from pensieve.runner.swapper import DEFAULT_STAGING_CHUNKS, METHODS, KVSwapper

REFERENCE_GBPS = 55.0  # measured on the H200: large pinned copies, one direction
TARGET_GBPS = 45.0  # issue 13: each way, scattered ids, 64-1024 chunks
CONCURRENT_GBPS = 46.6  # H200 raw H2D + D2H at once, each way


def timed(fn: Callable[[], dict[str, float]], reps: int) -> dict[str, float]:
    """Median wall time of ``fn`` (plus the medians of what it reports), after one warm-up."""
    fn()
    runs = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        extra = fn()
        torch.cuda.synchronize()
        runs.append({"s": time.perf_counter() - t0, **extra})
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def swapper_step(sw: KVSwapper, plan: SwapPlan) -> Callable[[], dict[str, float]]:
    def step() -> dict[str, float]:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        ready = sw.start_step(plan)
        out = {"enqueue_s": time.perf_counter() - t0}
        l0 = None
        if ready is not None and plan.swap_in:
            ready(0)  # the compute stream waits for layer 0's swap-ins
            l0 = torch.cuda.Event(enable_timing=True)
            l0.record()
        sw.end_step()
        out["step_s"] = time.perf_counter() - t0
        sw.finish_step()
        if l0 is not None:
            l0.synchronize()
            out["layer0_s"] = start.elapsed_time(l0) / 1e3
        return out

    return step


def raw_copies(sw: KVSwapper, nbytes: int, reps: int) -> list[dict]:
    """One large copy per direction, and both directions at once on two streams (two
    disjoint pieces of the pinned CPU tier, whatever its layout)."""
    elems = nbytes // sw.host_tier.element_size()
    flat = sw.host_tier.view(-1)
    assert flat.numel() >= 2 * elems
    host, host2 = flat[:elems], flat[elems:2 * elems]
    dev = sw.gpu_caches[0].reshape(-1)[:elems]
    dev2 = sw.gpu_caches[1].reshape(-1)[:elems]
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    # Each on a stream of its own, not the default (compute) stream: once that stream has
    # copied to or from the CPU tier, its later work waits for the swap steps' copies, which
    # skewed the layer-0 column (docs/performance_history.md, "A timeline of one swap step").
    def h2d() -> dict[str, float]:
        with torch.cuda.stream(s1):
            dev.copy_(host, non_blocking=True)
        s1.synchronize()
        return {}

    def d2h() -> dict[str, float]:
        with torch.cuda.stream(s2):
            host.copy_(dev, non_blocking=True)
        s2.synchronize()
        return {}

    def both() -> dict[str, float]:
        with torch.cuda.stream(s1):
            dev.copy_(host, non_blocking=True)
        with torch.cuda.stream(s2):
            host2.copy_(dev2, non_blocking=True)
        s1.synchronize()
        s2.synchronize()
        return {}

    rows = []
    for name, fn, direction in (("raw", h2d, "in"), ("raw", d2h, "out"),
                                ("raw 2 streams", both, "in+out")):
        t = timed(fn, reps)
        add(rows, {"method": name, "dir": direction, "chunks": 0, "bytes": nbytes, **t})
    return rows


def plans(n: int, pattern: str, num_gpu: int, num_cpu: int, rng: random.Random
          ) -> dict[str, list[tuple[int, int]]]:
    """Swap-in and swap-out pairs (gpu, cpu) of ``n`` chunks each, on disjoint GPU blocks and
    disjoint CPU blocks (so in+out may run concurrently). ``random``: both sides in random
    order; ``direct``: consecutive on both sides; ``scattered``: CPU ids pairwise
    non-adjacent, GPU ids random."""
    if pattern == "direct":
        g_in, g_out = list(range(n)), list(range(num_gpu - n, num_gpu))
        c_in, c_out = list(range(n)), list(range(num_cpu - n, num_cpu))
    else:
        g = rng.sample(range(num_gpu), 2 * n)
        g_in, g_out = g[:n], g[n:]
        pool = range(0, num_cpu, 2) if pattern == "scattered" else range(num_cpu)
        c = rng.sample(pool, 2 * n)
        c_in, c_out = c[:n], c[n:]
    return {"in": list(zip(g_in, c_in, strict=True)), "out": list(zip(g_out, c_out, strict=True))}


def step_plans(n: int, steps: int, num_gpu: int, num_cpu: int, rng: random.Random
               ) -> list[SwapPlan]:
    """``steps`` in + out plans of ``n`` chunks each way, random ids. No block is both swapped
    in and swapped out by any of them: they cycle through as many plans on disjoint GPU and
    CPU blocks as the tiers hold (at least one), so a step's swap-ins never wait for an
    earlier step's swap-outs."""
    sets = max(1, min(steps, num_gpu // (2 * n), num_cpu // (2 * n)))
    p = plans(n * sets, "random", num_gpu, num_cpu, rng)
    cycle = [SwapPlan(swap_in=[(c, g) for g, c in p["in"][k * n:(k + 1) * n]],
                      swap_out=p["out"][k * n:(k + 1) * n]) for k in range(sets)]
    return [cycle[k % sets] for k in range(steps)]


def swapper_steps(sw: KVSwapper, step_plans_: list[SwapPlan]) -> Callable[[], dict[str, float]]:
    """The plans as consecutive serving steps: each waits for its swap-ins only, and the
    background swap-outs of the earlier steps stay in flight; then every copy is waited for.
    Reports the median time from a step's start to its swap-ins done, and of its enqueue."""
    def steps() -> dict[str, float]:
        ins, enqueue = [], []
        for plan in step_plans_:
            t0 = time.perf_counter()
            sw.start_step(plan)
            enqueue.append(time.perf_counter() - t0)
            sw.end_step()
            ins.append(time.perf_counter() - t0)
        sw.finish_step()
        return {"step_s": statistics.median(ins), "enqueue_s": statistics.median(enqueue)}

    return steps


def method_rows(sw: KVSwapper, sizes: list[int], patterns: list[str], num_gpu: int,
                num_cpu: int, step_bytes: int, reps: int, seed: int, steps: int = 0
                ) -> list[dict]:
    rows = []
    programs = sw.num_programs if sw.method == "staged" else None
    for n in sizes:
        for pattern in patterns:
            p = plans(n, pattern, num_gpu, num_cpu, random.Random(f"{seed}{n}{pattern}"))
            swap_in = [(c, g) for g, c in p["in"]]
            for direction, plan in (("in", SwapPlan(swap_in=swap_in)),
                                    ("out", SwapPlan(swap_out=p["out"])),
                                    ("in+out", SwapPlan(swap_in=swap_in, swap_out=p["out"]))):
                t = timed(swapper_step(sw, plan), reps)
                add(rows, {"method": sw.method, "pattern": pattern, "dir": direction,
                           "chunks": n, "programs": programs, "bytes": n * step_bytes, **t})
        if steps > 1 and sw.method == "staged":
            seq = step_plans(n, steps, num_gpu, num_cpu, random.Random(f"{seed}{n}steps"))
            t = timed(swapper_steps(sw, seq), reps)
            add(rows, {"method": sw.method, "pattern": "random", "dir": f"in+out x{steps}",
                       "chunks": n, "steps": steps, "programs": programs,
                       "bytes": steps * n * step_bytes, **t})
    return rows


def sweep_rows(sw: KVSwapper, programs: list[int], tiles: list[int], n: int, num_gpu: int,
               num_cpu: int, step_bytes: int, reps: int, seed: int, gemm_n: int) -> list[dict]:
    """Kernel bandwidth per (programs, tile) and the GEMM slowdown beside in+out copies."""
    p = plans(n, "random", num_gpu, num_cpu, random.Random(seed))
    swap_in = [(c, g) for g, c in p["in"]]
    both = SwapPlan(swap_in=swap_in, swap_out=p["out"])
    a = torch.randn(gemm_n, gemm_n, device="cuda", dtype=torch.bfloat16)

    def gemms(k: int, plan: SwapPlan | None = None) -> float:
        """Host time of ``k`` GEMMs on the compute stream, beside ``plan``'s copies if given
        (issued first; the compute stream alone is synchronised, not the copy streams)."""
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if plan is not None:
            sw.start_step(plan)
        for _ in range(k):
            a @ a
        torch.cuda.current_stream().synchronize()
        t = time.perf_counter() - t0
        sw.finish_step()
        return t

    gemms(2)
    one = statistics.median(gemms(1) for _ in range(5))
    rows = []
    for tile in tiles:
        sw.tile_bytes = tile
        for prog in programs:
            sw.num_programs = prog
            for direction, plan in (("in", SwapPlan(swap_in=swap_in)),
                                    ("out", SwapPlan(swap_out=p["out"])), ("in+out", both)):
                t = timed(swapper_step(sw, plan), reps)
                row = {"method": sw.method, "pattern": "random", "dir": direction, "chunks": n,
                       "programs": prog, "tile_bytes": tile, "bytes": n * step_bytes, **t}
                if direction == "in+out" and tile == tiles[0]:
                    k = max(1, round(t["s"] / one))  # as long as the copies, alone
                    alone, beside = [], []
                    for _ in range(3):
                        alone.append(gemms(k))
                        beside.append(gemms(k, both))
                    row["gemm_slowdown"] = statistics.median(beside) / statistics.median(alone)
                add(rows, row)
    sw.tile_bytes = None
    return rows


HEADER = (f"{'method':<15}{'pattern':>9}{'dir':>11}{'chunks':>7}{'prog':>6}{'tile':>7}"
          f"{'MB/dir':>9}{'ms':>9}{'GB/s':>8}{'vs 45':>7}{'enqueue':>9}{'step':>9}"
          f"{'layer0':>8}{'gemm x':>8}")


def fmt_row(r: dict) -> str:
    def ms(key: str) -> str:
        return f"{r[key] * 1e3:.2f}" if key in r else "-"

    prog = str(r.get("programs") or "-")
    t = r.get("tile_bytes")
    tile = "-" if not t else f"{t // 1024}K" if t >= 1024 else f"{t}B"
    gx = f"{r['gemm_slowdown']:.2f}" if "gemm_slowdown" in r else "-"
    return (f"{r['method']:<15}{r.get('pattern', '-'):>9}{r['dir']:>11}{r['chunks']:>7}"
            f"{prog:>6}{tile:>7}{r['bytes'] / 1e6:>9.1f}{ms('s'):>9}{r['gbps']:>8.1f}"
            f"{r['gbps'] / TARGET_GBPS:>7.0%}{ms('enqueue_s'):>9}{ms('step_s'):>9}"
            f"{ms('layer0_s'):>8}{gx:>8}")


def fmt_table(rows: list[dict]) -> str:
    return "\n".join([HEADER, *(fmt_row(r) for r in rows)])


def add(rows: list[dict], row: dict) -> None:
    """Append a measured row (GB/s per direction) and print it at once (a run cut short by a
    timeout still shows what it measured)."""
    row["gbps"] = row["bytes"] / row["s"] / 1e9
    row["vs_target"] = row["gbps"] / TARGET_GBPS
    rows.append(row)
    print(fmt_row(row), flush=True)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, sweep = result["rows"], result["sweep"]
    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(14 if sweep else 8, 5),
                             squeeze=False)
    ax = axes[0][0]
    series = sorted({(r["method"], r["dir"]) for r in rows if r["chunks"] and
                     r.get("pattern") == "random"})
    sizes = sorted({r["chunks"] for r in rows if r["chunks"]})
    width = 0.8 / max(1, len(series))
    for i, (method, direction) in enumerate(series):
        ys = [next((r["gbps"] for r in rows if r["method"] == method and r["dir"] == direction
                    and r["chunks"] == n and r.get("pattern") == "random"), 0.0) for n in sizes]
        ax.bar([j + i * width for j in range(len(sizes))], ys, width,
               label=f"{method} {direction}")
    for r in rows:
        if r["method"].startswith("raw"):
            ax.axhline(r["gbps"], ls=":", lw=1, color="gray")
    ax.axhline(TARGET_GBPS, ls="--", color="red", label=f"target {TARGET_GBPS:.0f} GB/s")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], [str(n) for n in sizes])
    ax.set_xlabel("chunks per step (random GPU and CPU ids)")
    ax.set_ylabel("GB/s per direction")
    ax.set_title(f"{result['device']}: swap bandwidth (dotted: raw copies)")
    ax.legend(fontsize=7)
    if sweep:
        ax = axes[0][1]
        tiles = sorted({r["tile_bytes"] for r in sweep})
        methods = sorted({r["method"] for r in sweep})
        for method in methods:
            for tile in tiles:
                for direction in ("in", "out", "in+out"):
                    pts = sorted((r["programs"], r["gbps"]) for r in sweep
                                 if r["tile_bytes"] == tile and r["dir"] == direction
                                 and r["method"] == method)
                    ax.plot([p for p, _ in pts], [g for _, g in pts], marker="o",
                            ls="-",
                            label=f"{method} {direction}, tile {tile // 1024}K")
        ax.axhline(TARGET_GBPS, ls="--", color="red")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("programs (persistent grid)")
        ax.set_ylabel("GB/s per direction")
        ax.set_title(f"program / tile sweep, {sweep[0]['chunks']} chunks")
        ax.legend(fontsize=6)
        ax2 = None
        for method in methods:
            slow = sorted((r["programs"], r["gemm_slowdown"]) for r in sweep
                          if "gemm_slowdown" in r and r["method"] == method)
            if slow:
                ax2 = ax2 or ax.twinx()
                ax2.plot([p for p, _ in slow], [s for _, s in slow], "k-", marker="x",
                         label=f"gemm x, {method}")
        if ax2 is not None:
            ax2.set_ylabel("GEMM time beside in+out copies / alone (black)")
            ax2.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """The KV shape's options (default: the 13B GQA-10 shape, chunks of 32 tokens)."""
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--kv-heads", type=int, default=10)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=32)


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python benchmarks/swap_bandwidth.py``."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(ap)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--methods", nargs="+", default=list(METHODS),
                    choices=list(METHODS))
    ap.add_argument("--patterns", nargs="+", default=["random"],
                    choices=["random", "direct", "scattered"])
    ap.add_argument("--programs", type=int, default=DEFAULT_PROGRAMS,
                    help="kernel programs for the main rows")
    ap.add_argument("--staging-chunks", type=int, default=DEFAULT_STAGING_CHUNKS,
                    help="staged: chunks per staging piece and half")
    ap.add_argument("--sweep-programs", type=int, nargs="*", default=[16, 32])
    ap.add_argument("--sweep-tiles", type=int, nargs="*", default=[16384, 32768])
    ap.add_argument("--sweep-chunks", type=int, default=256)
    ap.add_argument("--gemm-n", type=int, default=8192, help="GEMM size of the sweep's probe")
    ap.add_argument("--gpu-blocks", type=int, default=None,
                    help="GPU blocks per layer (default: 2.5 x the largest size)")
    ap.add_argument("--cpu-blocks", type=int, default=None,
                    help="CPU blocks per layer (default: 2 x the largest size, 4 x with "
                         "--patterns scattered)")
    ap.add_argument("--steps", type=int, default=8,
                    help="the 'in+out xK' row: K in + out steps back to back per size, for "
                         "the staged method (0: no such row)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the JSON result here")
    ap.add_argument("--plot", default=None, help="write the PNG figure here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")

    import triton

    dtype = getattr(torch, args.dtype)
    biggest = max([*args.sizes, args.sweep_chunks if args.sweep_programs else 0])
    num_gpu = args.gpu_blocks or 2 * biggest + biggest // 2
    num_cpu = args.cpu_blocks or (4 if "scattered" in args.patterns else 2) * biggest
    layout = KVLayout(args.layers, args.kv_heads, args.head_dim, args.chunk, dtype)
    caches = layout.allocate(num_gpu, torch.device("cuda"))
    for c in caches:
        c.normal_()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    step_bytes = 0
    gib = 2**30
    rows: list[dict] = []
    sweep: list[dict] = []
    pin_s: dict[str, float] = {}
    header = ""
    for method in args.methods:
        t0 = time.perf_counter()
        sw = KVSwapper(layout, caches, num_cpu, method, num_programs=args.programs,
                       staging_chunks=args.staging_chunks)
        pin_s[method] = time.perf_counter() - t0
        step_bytes = sw.chunk_bytes  # one chunk, all layers
        if not header:
            header = (f"{torch.cuda.get_device_name()} ({sms} SMs)  torch {torch.__version__}  "
                      f"triton {triton.__version__}\n{args.layers} layers, "
                      f"{sw.layer_bytes / 1024:.0f} KB per chunk per layer (K+V); GPU tier "
                      f"{num_gpu * step_bytes / gib:.1f} GiB ({num_gpu} blocks), CPU tier "
                      f"{num_cpu * step_bytes / gib:.1f} GiB ({num_cpu} blocks)")
            print(header + "\n\n" + HEADER, flush=True)
            rows += raw_copies(sw, min(256 * 2**20, num_cpu * sw.layer_bytes // 2), args.reps)
        print(f"{method}: CPU tier ({sw.host_layout}) pinned and mapped (and kernel compiled) "
              f"in {pin_s[method]:.1f} s; kernel programs {sw.num_programs} of {sms} SMs"
              + (f"; staging {args.staging_chunks} chunks per piece, 2 halves"
                 if method == "staged" else ""), flush=True)
        rows += method_rows(sw, args.sizes, args.patterns, num_gpu, num_cpu, step_bytes,
                            args.reps, args.seed, args.steps)
        if method == "staged" and args.sweep_programs:
            print(f"{method} sweep ({args.sweep_chunks} chunks, random ids; gemm x: "
                  f"{args.gemm_n}^3 bf16 GEMMs beside in+out copies / alone)", flush=True)
            sweep += sweep_rows(sw, args.sweep_programs,
                                args.sweep_tiles or [DEFAULT_TILE_BYTES], args.sweep_chunks,
                                num_gpu, num_cpu, step_bytes, args.reps, args.seed,
                                args.gemm_n)
            sw.num_programs = args.programs
        del sw
        gc.collect()
    report(args, rows, sweep, {"sms": sms, "gpu_blocks": num_gpu, "cpu_blocks": num_cpu,
                               "chunk_bytes_per_layer": layout.layer_bytes,
                               "pin_s": pin_s})
    return 0


def report(args: argparse.Namespace, rows: list[dict], sweep: list[dict], run: dict) -> None:
    """Print the tables and write ``--out`` (JSON) and ``--plot`` (PNG)."""
    import triton

    print("\n" + fmt_table(rows))
    if sweep:
        print(f"\nsweep ({args.sweep_chunks} chunks, random ids; gemm x: {args.gemm_n}^3 "
              "bf16 GEMMs beside in+out copies / alone)\n" + fmt_table(sweep))
    print(f"\nGB = 1e9 bytes; GB/s per direction; ms = median wall time of one step; "
          f"enqueue/step/layer0 in ms; kernel default {DEFAULT_PROGRAMS} programs, "
          f"{DEFAULT_TILE_BYTES // 1024} KB tiles; targets {TARGET_GBPS} GB/s each way "
          f"({CONCURRENT_GBPS} concurrent raw), reference {REFERENCE_GBPS} one way.")
    config = {k: v for k, v in run.items() if k != "sms"}
    result = {"device": torch.cuda.get_device_name(), "sms": run["sms"],
              "torch": torch.__version__, "triton": triton.__version__,
              "config": vars(args) | config | {"default_programs": DEFAULT_PROGRAMS,
                                               "default_tile_bytes": DEFAULT_TILE_BYTES},
              "reference_gbps": REFERENCE_GBPS, "target_gbps": TARGET_GBPS,
              "rows": rows, "sweep": sweep}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    if args.plot:
        try:
            plot(result, args.plot)
            print(f"wrote {args.plot}")
        except ImportError as e:
            print(f"no plot: {e}")


if __name__ == "__main__":
    raise SystemExit(main())
