"""How much step time does swap-in add: pipelined layer by layer vs. swapping before the step.

A unified batch of ``--batch`` requests, each with ``--context`` cached tokens and ``--new``
new tokens, runs through the real ModelRunner. ``N`` of the requests' leading chunks are on
the CPU tier and are swapped in during the step. Three timings per N (median of ``--reps``):

* ``no swap``: the same step with every chunk already on the GPU (the floor);
* ``pipelined``: the swap plan runs on the copy stream, layer i's attention waits on layer i;
* ``serial``: all chunks copied and synchronised first, then the step.

Exposed time = timing - floor. Prints a table and writes JSON to ``--out``.

    python benchmarks/swap_overlap.py --model llama2-13b-gqa10 --out swap_overlap.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pensieve.core.outputs import QueryRange, ScheduledRequest, SchedulerOutput, SwapPlan
from pensieve.core.sampling_params import SamplingParams
from pensieve.models.loader import load_model
from pensieve.runner.model_runner import ModelRunner, allocate_kv_caches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="llama2-13b-gqa10")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--swap-chunks", default="0,64,256,512,1024")
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    dev = torch.device("cuda")
    model, cfg = load_model(args.model, dtype=torch.bfloat16, device=dev, load_format="dummy")
    c = args.chunk
    per_req = -(-(args.context + args.new) // c)
    n_gpu = per_req * args.batch + 16
    sizes = [int(x) for x in args.swap_chunks.split(",")]
    n_cpu = max(max(sizes), 1)
    caches = allocate_kv_caches(model.num_layers, n_gpu, c, model.num_kv_heads, model.head_dim,
                                torch.bfloat16, dev)
    for t in caches:
        t.normal_()
    runner = ModelRunner(model, caches, c, num_cpu_blocks=n_cpu)
    for t in runner.swapper.cpu_caches:
        t.normal_()
    tables = [list(range(i * per_req, (i + 1) * per_req)) for i in range(args.batch)]
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    reqs = [ScheduledRequest(f"r{i}", tables[i],
                             [QueryRange(args.context, [7] * args.new)], True, greedy, 0)
            for i in range(args.batch)]
    chunk_bytes = runner.swapper.block_bytes * model.num_layers

    def plan_for(n: int) -> SwapPlan:
        # the leading chunks of each request, round robin, from consecutive CPU blocks
        lead = [tables[i % args.batch][i // args.batch] for i in range(n)]
        return SwapPlan(swap_in=list(zip(range(n), lead)))

    def timed(fn) -> float:  # noqa: ANN001
        out = []
        for _ in range(args.reps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return statistics.median(out[1:]) * 1e3

    plain = SchedulerOutput(requests=reqs)
    rows = []
    floor = timed(lambda: runner.execute(plain))
    for n in sizes:
        plan = plan_for(n)
        piped = timed(lambda plan=plan: runner.execute(SchedulerOutput(reqs, swaps=plan)))

        def serial(plan: SwapPlan = plan) -> None:
            runner.swapper.start_step(plan)
            runner.swapper.finish_step()
            runner.execute(plain)

        ser = timed(serial)
        gb = n * chunk_bytes / 1e9
        rows.append({"swap_chunks": n, "swap_gb": round(gb, 3), "floor_ms": round(floor, 2),
                     "pipelined_ms": round(piped, 2), "serial_ms": round(ser, 2),
                     "pipelined_exposed_ms": round(piped - floor, 2),
                     "serial_exposed_ms": round(ser - floor, 2),
                     "copy_only_ms_at_55GBps": round(gb / 55 * 1e3, 2)})
    print(f"{args.model} bf16, batch {args.batch} x (context {args.context} + {args.new} new), "
          f"chunk {c}, {chunk_bytes / 1e6:.2f} MB per chunk (all layers)")
    print(f"{'chunks':>7} {'GB':>6} {'floor':>8} {'piped':>8} {'serial':>8} "
          f"{'exp.pipe':>9} {'exp.ser':>8} {'copy@55':>8}")
    for r in rows:
        print(f"{r['swap_chunks']:>7} {r['swap_gb']:>6} {r['floor_ms']:>8} {r['pipelined_ms']:>8} "
              f"{r['serial_ms']:>8} {r['pipelined_exposed_ms']:>9} {r['serial_exposed_ms']:>8} "
              f"{r['copy_only_ms_at_55GBps']:>8}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "batch": args.batch, "context": args.context,
                       "new": args.new, "chunk": c, "gpu": torch.cuda.get_device_name(),
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
