"""Swap bandwidth between the GPU tier and the pinned CPU tier, through KVSwapper.

Llama 2-13B GQA shape by default (40 layers, 10 KV heads, head_dim 128, bf16, chunk 32: 160 KB
of K+V per chunk per layer). For each chunk count and each block-id pattern it times one step
(``start_step`` .. ``finish_step``, host wall clock after a device synchronize; median of
``--reps`` after a warm-up) moving that many chunks in, out, or both (in and out in the same
step, one copy stream, so they run one after the other: swap-in first)::

    direct     CPU ids and GPU ids consecutive: copies straight between the tiers
    contig     CPU ids consecutive, GPU ids random: gather/scatter kernel + one copy per K/V
    scattered  CPU ids pairwise non-adjacent, GPU ids random: one copy per chunk for K and V
    naive      one copy per chunk per layer for K and for V, straight into/out of the GPU cache

beside raw single copies (H2D, D2H and both at once on two streams) and the 55 GB/s reference
(H200, large copies, one direction). ``enqueue`` is the host time of ``start_step``;
``layer0`` the device time until layer 0's swap-ins are usable by the compute stream.

    python benchmarks/swap_bandwidth.py --out swap_bandwidth.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import torch

from pensieve.core.outputs import SwapPlan
from pensieve.runner.swapper import KVSwapper

REFERENCE_GBPS = 55.0  # measured on the H200: large pinned copies, one direction


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
        sw.finish_step()
        if l0 is not None:
            l0.synchronize()
            out["layer0_s"] = start.elapsed_time(l0) / 1e3
        return out

    return step


def naive_step(
    sw: KVSwapper, pairs: list[tuple[int, int]], direction: str, stream: torch.cuda.Stream
) -> Callable[[], dict[str, float]]:
    """``pairs``: (gpu, cpu). Two copies (K, V) per chunk per layer, no batching."""

    def step() -> dict[str, float]:
        t0 = time.perf_counter()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for gpu, cpu in zip(sw.gpu_caches, sw.cpu_caches, strict=True):
                for g, c in pairs:
                    for kv in (0, 1):
                        if direction == "in":
                            gpu[kv, g].copy_(cpu[kv, c], non_blocking=True)
                        else:
                            cpu[kv, c].copy_(gpu[kv, g], non_blocking=True)
        enqueue = time.perf_counter() - t0
        stream.synchronize()
        return {"enqueue_s": enqueue}

    return step


def raw_copies(sw: KVSwapper, nbytes: int, reps: int) -> list[dict]:
    """One large copy per direction, and both directions at once on two streams."""
    elems = nbytes // sw.cpu_caches[0].element_size()
    host = sw.cpu_caches[0].view(-1)[:elems]
    dev = sw.gpu_caches[0].view(-1)[:elems]
    host2 = sw.cpu_caches[1].view(-1)[:elems]
    dev2 = sw.gpu_caches[1].view(-1)[:elems]
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def h2d() -> dict[str, float]:
        dev.copy_(host, non_blocking=True)
        return {}

    def d2h() -> dict[str, float]:
        host.copy_(dev, non_blocking=True)
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
    for name, fn, moved in (("raw H2D", h2d, nbytes), ("raw D2H", d2h, nbytes),
                            ("raw H2D+D2H (2 streams)", both, 2 * nbytes)):
        t = timed(fn, reps)
        rows.append({"case": name, "dir": "-", "chunks": 0, "runs": 1, "bytes": moved, **t})
    return rows


def plans(n: int, pattern: str, num_gpu: int, num_cpu: int, rng: random.Random) -> dict:
    """Swap-in and swap-out pairs (gpu, cpu) of ``n`` chunks for one pattern."""
    if pattern == "direct":
        g_in, g_out = list(range(n)), list(range(num_gpu - n, num_gpu))
    else:
        g_in, g_out = rng.sample(range(num_gpu), n), rng.sample(range(num_gpu), n)
    if pattern == "scattered":
        c_in, c_out = rng.sample(range(0, num_cpu, 2), n), rng.sample(range(0, num_cpu, 2), n)
    else:
        c_in, c_out = list(range(n)), list(range(num_cpu - n, num_cpu))
    return {"in": list(zip(g_in, c_in, strict=True)), "out": list(zip(g_out, c_out, strict=True))}


def runs_of(cpu_ids: list[int]) -> int:
    s = sorted(cpu_ids)
    return 1 + sum(b != a + 1 for a, b in zip(s[:-1], s[1:], strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--kv-heads", type=int, default=10)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--gpu-blocks", type=int, default=None,
                    help="GPU blocks per layer (default: 1.25 x the largest size)")
    ap.add_argument("--cpu-blocks", type=int, default=None,
                    help="CPU blocks per layer (default: 2 x the largest size)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-naive", action="store_true", help="skip the one-copy-per-chunk rows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the JSON result here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")

    dtype = getattr(torch, args.dtype)
    biggest = max(args.sizes)
    num_gpu = args.gpu_blocks or biggest + biggest // 4
    num_cpu = args.cpu_blocks or 2 * biggest
    shape = (2, num_gpu, args.chunk, args.kv_heads, args.head_dim)
    caches = [torch.zeros(shape, dtype=dtype, device="cuda") for _ in range(args.layers)]
    t0 = time.perf_counter()
    sw = KVSwapper(caches, num_cpu)
    pin_s = time.perf_counter() - t0
    step_bytes = sw.block_bytes * args.layers  # one chunk, all layers
    gib = 2**30
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"{args.layers} layers, {sw.block_bytes / 1024:.0f} KB per chunk per layer; "
          f"GPU tier {num_gpu * step_bytes / gib:.1f} GiB, "
          f"CPU tier {num_cpu * step_bytes / gib:.1f} GiB (pinned in {pin_s:.1f} s)")

    rng = random.Random(args.seed)
    raw_bytes = min(256 * 2**20, min(num_cpu, num_gpu) * sw.block_bytes // 2)
    rows = raw_copies(sw, raw_bytes, args.reps)
    side = torch.cuda.Stream()
    for n in args.sizes:
        for pattern in ("direct", "contig", "scattered"):
            p = plans(n, pattern, num_gpu, num_cpu, rng)
            swap_in = [(c, g) for g, c in p["in"]]
            for direction, plan in (("in", SwapPlan(swap_in=swap_in)),
                                    ("out", SwapPlan(swap_out=p["out"])),
                                    ("in+out", SwapPlan(swap_in=swap_in, swap_out=p["out"]))):
                t = timed(swapper_step(sw, plan), args.reps)
                moved = (len(plan.swap_in) + len(plan.swap_out)) * step_bytes
                rows.append({"case": pattern, "dir": direction, "chunks": n,
                             "runs": runs_of([c for _, c in p["in"]]), "bytes": moved, **t})
        if not args.no_naive:
            p = plans(n, "scattered", num_gpu, num_cpu, rng)
            for direction in ("in", "out"):
                t = timed(naive_step(sw, p[direction], direction, side), args.reps)
                rows.append({"case": "naive", "dir": direction, "chunks": n, "runs": n,
                             "bytes": n * step_bytes, **t})

    print(f"\n{'case':<24}{'dir':>7}{'chunks':>7}{'runs':>6}{'MB':>9}{'ms':>9}{'GB/s':>8}"
          f"{'vs 55':>7}{'enqueue':>9}{'layer0':>8}")
    for r in rows:
        r["gbps"] = r["bytes"] / r["s"] / 1e9
        r["vs_reference"] = r["gbps"] / REFERENCE_GBPS
        enq = f"{r['enqueue_s'] * 1e3:.2f}" if "enqueue_s" in r else "-"
        l0 = f"{r['layer0_s'] * 1e3:.2f}" if "layer0_s" in r else "-"
        print(f"{r['case']:<24}{r['dir']:>7}{r['chunks']:>7}{r['runs']:>6}"
              f"{r['bytes'] / 1e6:>9.1f}{r['s'] * 1e3:>9.2f}{r['gbps']:>8.1f}"
              f"{r['vs_reference']:>7.0%}{enq:>9}{l0:>8}")
    print("\nGB = 1e9 bytes; ms = median wall time of one step; enqueue/layer0 in ms.")
    if args.out:
        result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "config": vars(args) | {"gpu_blocks": num_gpu, "cpu_blocks": num_cpu,
                                          "chunk_bytes_per_layer": sw.block_bytes,
                                          "pin_s": pin_s},
                  "reference_gbps": REFERENCE_GBPS, "rows": rows}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
