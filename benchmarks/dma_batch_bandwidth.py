"""Copy-engine bandwidth of batched copies (``cuMemcpyBatchAsync``) between scattered chunks of
the pinned chunk-major CPU tier and the GPU, one way and both ways at once.

The question it answers: can swap-ins go through the copy engines *and* stay pipelined layer by
layer, so that swap-ins and swap-outs together reach the concurrent PCIe rate? Issued one
``cudaMemcpyAsync`` at a time from Python (~11 us each), a copy per chunk per group of layers
cost more host time than it saved (``docs/performance.md``, "Staged swap-ins by groups of
layers"). One driver call per group takes that cost off the host.

Llama 2-13B GQA-10 shape by default (40 layers, 10 KV heads, head_dim 128, bf16, chunk 32:
6.5 MB a chunk). CPU tier ``[Ncpu, L, 2, C, Hkv, D]``, pinned; CPU block ids at random. Rows:

    in G=g       CPU -> GPU staging buffer, one copy per chunk per group of L/g layers, one
                 batch call per group (the first group's copies are what layer 0 waits for)
    in direct    CPU -> the GPU caches' own blocks (random GPU ids), one copy per chunk per
                 layer per K/V (80 KB), one batch call per layer: no staging, no scatter
    out          GPU staging buffer -> CPU, one copy per chunk, one batch call
    X + out      the in row on one stream and the out row on another at once (disjoint
                 CPU blocks); GB/s each way

GB/s = bytes of one direction / device time from a common start event to that direction's
last event (median of ``--reps``); ``first ms``: device time until the first group (layer 0)
is in; ``issue ms``: host time of the batch calls. Every row checks its bytes.

    python benchmarks/dma_batch_bandwidth.py --out dma_batch.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np
import torch

from pensieve.runner.copy_engine import CopyEngine, pieces

CONCURRENT_GBPS = 46.6  # H200, raw H2D + D2H at once, each way (the brief)
def descriptors(dst_base: int, src_base: int, dst_offsets: list[int], src_offsets: list[int],
                size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return pieces(dst_base, np.asarray(dst_offsets), 1, src_base, np.asarray(src_offsets), 1,
                  size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 4, 8, 40])
    ap.add_argument("--cpu-blocks", type=int, default=2304)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--kv-heads", type=int, default=10)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--chunk-size", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    rng = random.Random(args.seed)
    L, half = args.layers, args.chunk_size * args.kv_heads * args.head_dim * 2  # bytes of K
    layer_b, chunk_b = 2 * half, 2 * half * L
    nmax = max(args.chunks)
    if 2 * nmax > args.cpu_blocks:
        raise SystemExit("--cpu-blocks must be >= 2 x the largest --chunks")
    host = torch.empty(args.cpu_blocks * chunk_b, dtype=torch.uint8)
    words = host.view(torch.int64)
    torch.arange(words.numel(), dtype=torch.int64, out=words)  # every 8-byte word its own
    err = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)
    if int(err) != 0:
        raise SystemExit(f"cudaHostRegister: error {err}")
    hp = host.data_ptr()
    stage_in = torch.empty(nmax * chunk_b, dtype=torch.uint8, device=dev)
    stage_out = torch.randint(0, 255, (nmax * chunk_b,), dtype=torch.uint8, device=dev)
    ngpu = 2 * nmax
    caches = torch.empty((L, 2, ngpu, half), dtype=torch.uint8, device=dev)
    engine = CopyEngine(dev)
    if not engine.batched:
        raise SystemExit("this driver has no cuMemcpyBatchAsync")
    s_in = torch.cuda.Stream(dev, priority=-1)
    s_out = torch.cuda.Stream(dev)
    rows: list[dict[str, object]] = []
    print(f"cuMemcpyBatchAsync; chunk {chunk_b / 1e6:.2f} MB")

    def plan_in(n: int, kind: str | int, cpu: list[int], gpu: list[int]
                ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        if kind == "direct":
            calls = []
            for layer in range(L):
                dst = [((layer * 2 + kv) * ngpu + g) * half for g in gpu for kv in (0, 1)]
                src = [c * chunk_b + layer * layer_b + kv * half for c in cpu for kv in (0, 1)]
                calls.append(descriptors(caches.data_ptr(), hp, dst, src, half))
            return calls
        g = int(kind)
        gb = chunk_b // g
        return [descriptors(stage_in.data_ptr(), hp, [j * chunk_b + k * gb for j in range(n)],
                            [c * chunk_b + k * gb for c in cpu], gb) for k in range(g)]

    def check_in(kind: str | int, cpu: list[int], gpu: list[int]) -> None:
        for j in (0, len(cpu) - 1):
            want = host[cpu[j] * chunk_b:(cpu[j] + 1) * chunk_b]
            if kind == "direct":
                got = torch.stack([caches[layer, kv, gpu[j]] for layer in range(L)
                                   for kv in (0, 1)]).flatten().cpu()
            else:
                got = stage_in[j * chunk_b:(j + 1) * chunk_b].cpu()
            if not torch.equal(want, got):
                raise SystemExit(f"in {kind}: chunk {j} differs")

    def check_out(cpu: list[int]) -> None:
        for j in (0, len(cpu) - 1):
            if not torch.equal(host[cpu[j] * chunk_b:(cpu[j] + 1) * chunk_b],
                               stage_out[j * chunk_b:(j + 1) * chunk_b].cpu()):
                raise SystemExit(f"out: chunk {j} differs")

    def run(ins: list | None, out: tuple | None) -> dict[str, float]:
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream())
        s_in.wait_event(start)
        s_out.wait_event(start)
        t0 = time.perf_counter()
        first = end_in = end_out = None
        if out is not None:
            with torch.cuda.stream(s_out):
                engine.copy(out[0], out[1], out[2], to_device=False)
            end_out = torch.cuda.Event(enable_timing=True)
            end_out.record(s_out)
        if ins is not None:
            for k, call in enumerate(ins):
                with torch.cuda.stream(s_in):
                    engine.copy(call[0], call[1], call[2], to_device=True)
                if k == 0:
                    first = torch.cuda.Event(enable_timing=True)
                    first.record(s_in)
            end_in = torch.cuda.Event(enable_timing=True)
            end_in.record(s_in)
        issue = time.perf_counter() - t0
        torch.cuda.synchronize()
        res = {"issue_ms": issue * 1e3}
        if first is not None and end_in is not None:
            res["first_ms"] = start.elapsed_time(first)
            res["in_ms"] = start.elapsed_time(end_in)
        if end_out is not None:
            res["out_ms"] = start.elapsed_time(end_out)
        return res

    def timed(ins: list | None, out: tuple | None) -> dict[str, float]:
        run(ins, out)
        reps = [run(ins, out) for _ in range(args.reps)]
        return {k: statistics.median(r[k] for r in reps) for k in reps[0]}

    for n in args.chunks:
        ids = rng.sample(range(args.cpu_blocks), 2 * n)
        cpu_in, cpu_out = ids[:n], ids[n:]
        gpu_in = rng.sample(range(ngpu), n)
        out_desc = descriptors(hp, stage_out.data_ptr(), [c * chunk_b for c in cpu_out],
                               [j * chunk_b for j in range(n)], chunk_b)
        gb = n * chunk_b / 1e9
        r = timed(None, out_desc)
        check_out(cpu_out)
        rows.append({"chunks": n, "row": "out", "out_gbps": gb / r["out_ms"] * 1e3, **r})
        for kind in [*args.groups, "direct"]:
            ins = plan_in(n, kind, cpu_in, gpu_in)
            name = f"in G={kind}" if kind != "direct" else "in direct"
            r = timed(ins, None)
            check_in(kind, cpu_in, gpu_in)
            rows.append({"chunks": n, "row": name, "in_gbps": gb / r["in_ms"] * 1e3, **r})
            r = timed(ins, out_desc)
            check_in(kind, cpu_in, gpu_in)
            check_out(cpu_out)
            rows.append({"chunks": n, "row": f"{name} + out", "in_gbps": gb / r["in_ms"] * 1e3,
                         "out_gbps": gb / r["out_ms"] * 1e3, **r})
    print(f"{'chunks':>6} {'row':<18} {'in GB/s':>8} {'out GB/s':>8} {'first ms':>8} "
          f"{'issue ms':>8}")
    for row in rows:
        nan = float("nan")
        print(f"{row['chunks']:>6} {row['row']:<18} {row.get('in_gbps', nan):>8.1f} "
              f"{row.get('out_gbps', nan):>8.1f} {row.get('first_ms', nan):>8.2f} "
              f"{row['issue_ms']:>8.2f}")
    print(f"(concurrent raw reference: {CONCURRENT_GBPS} GB/s each way)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    torch.cuda.cudart().cudaHostUnregister(hp)


if __name__ == "__main__":
    main()
