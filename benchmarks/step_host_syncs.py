"""Where the host waits for the device inside an eager step with prefill, and how long it
takes to issue one.

Serving agentic churn, the runner's host time until a prefill step's forward is issued
(``host_issue_s``) grew with the step: 6 ms for ~31 ms steps, 18-25 ms for 100-125 ms steps
(``docs/benchmarks.md``). Launching the same kernels should not take longer for more tokens,
unless something in the issue path waits for the device. This runs mixed steps eagerly
through ``ModelRunner.execute`` (``BATCH`` decodes at context ``CTX`` plus one turn of
``PREFILL`` new tokens after ``--history`` tokens, with ``--swap-in`` of the history's chunks
copied in from the CPU tier first), under ``torch.cuda.set_sync_debug_mode("warn")``, and
prints per configuration:

- the host's prepare and issue time and the step time (``RunnerOutput``; medians of
  ``--iters``);
- every call site that synchronised with the device during the step, with its count, and
  whether it came before the forward was issued (``issue``) or after (the sampler's read of
  the ids, expected).

Without CUDA the configurations run on the CPU (a test of the script) and no sync is
reported::

    python benchmarks/step_host_syncs.py --model llama2-13b-gqa10 --out step_host_syncs.json
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import pstats
import random
import statistics
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from decode_step import decode_step, setup
from mixed_step import mixed_step

from pensieve.core.outputs import SchedulerOutput, SwapPlan
from pensieve.runner.model_runner import ModelRunner

SRC = str(Path(__file__).resolve().parents[1] / "src")


def mixed(batch: int, ctx: int, prefill: int, history: int, swap_in: int, chunk: int,
          rng: random.Random, num_blocks: int) -> SchedulerOutput:
    """``batch`` decodes plus one turn of ``prefill`` tokens after ``history``
    (``mixed_step.mixed_step``), whose first ``swap_in`` chunks come from CPU blocks
    ``0 .. swap_in - 1``."""
    free = list(range(num_blocks))
    dec = decode_step(batch, ctx, chunk, rng, free)
    used = {b for s in dec.requests for b in s.block_table}
    step = mixed_step(dec, prefill, history, chunk, rng, [b for b in free if b not in used])
    table = step.requests[-1].block_table
    return dataclasses.replace(step, swaps=SwapPlan(swap_in=[(c, table[c])
                                                             for c in range(swap_in)]))


def sync_site(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame of the package (else of this repo) that led to a sync."""
    for frame in reversed(stack):
        if frame.filename.startswith(SRC):
            return f"{Path(frame.filename).relative_to(SRC)}:{frame.lineno} {frame.name}"
    last = stack[-1]
    return f"{Path(last.filename).name}:{last.lineno} {last.name}"


def run_config(runner: ModelRunner, sched: SchedulerOutput, iters: int, cuda: bool
               ) -> dict[str, Any]:
    for _ in range(2):
        runner.execute(sched)
    outs = []
    sites: Counter[str] = Counter()
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        stacks: list[list[traceback.FrameSummary]] = []

        def show(*_: Any, stacks: list = stacks, **__: Any) -> None:
            stacks.append(traceback.extract_stack()[:-2])

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                out = runner.execute(sched)
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
        outs.append(out)
        sites.update(sync_site(s) for s in stacks)
    med = {k: round(statistics.median(getattr(o, k) for o in outs) * 1e3, 3)
           for k in ("host_prepare_s", "host_issue_s", "step_time_s")}
    return {**{k.replace("_s", "_ms"): v for k, v in med.items()},
            "syncs_per_step": {k: v / iters for k, v in sites.most_common()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama2-13b-gqa10")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--configs", default="32x2048x512,32x2048x2048,32x2048x4096,64x2048x2048",
                    help="BATCHxCTXxPREFILL, comma-separated")
    ap.add_argument("--history", type=int, default=2048)
    ap.add_argument("--swap-in", type=int, nargs="+", default=[0, 64],
                    help="chunks of the history copied in from the CPU tier first")
    ap.add_argument("--kv-gb", type=float, default=40.0)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", type=int, default=0,
                    help="then cProfile this many steps of the first configuration (its first "
                         "--swap-in) and print the 25 functions of most own time")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    su = setup(args.model, getattr(torch, args.dtype), args.kv_gb, device)
    runner = ModelRunner(su.model, su.kv, su.chunk, num_cpu_blocks=max(args.swap_in))
    rows = []
    first: tuple[str, SchedulerOutput] | None = None
    for spec in args.configs.split(","):
        batch, ctx, prefill = (int(x) for x in spec.split("x"))
        for swap_in in args.swap_in:
            n = min(swap_in, args.history // su.chunk)
            sched = mixed(batch, ctx, prefill, args.history, n, su.chunk, random.Random(0),
                          su.num_blocks)
            first = first or (f"{batch} x {ctx} + {prefill}, swap-in {n}", sched)
            row = {"batch": batch, "ctx": ctx, "prefill": prefill, "history": args.history,
                   "swap_in": n, **run_config(runner, sched, args.iters, cuda)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.profile and first is not None:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.profile):
            runner.execute(first[1])
        prof.disable()
        print(f"cProfile of {args.profile} steps of {first[0]}:")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    result = {"model": args.model, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print("batch x ctx + prefill, swap-in | prepare / issue / step ms | syncs per step")
    for r in rows:
        print(f"{r['batch']} x {r['ctx']} + {r['prefill']}, {r['swap_in']} | "
              f"{r['host_prepare_ms']} / {r['host_issue_ms']} / {r['step_time_ms']} | "
              f"{r['syncs_per_step']}")


if __name__ == "__main__":
    main()
