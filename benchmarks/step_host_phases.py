"""Host time of a step with prefill and swap-ins, phase by phase, by groups of swap-in layers.

The step of ``benchmarks/step_swap_ins.py`` (``--batch`` decodes at ``--ctx``, one turn of
``--prefill`` new tokens whose first N history chunks come from random CPU blocks, and
``--swap-out`` background swap-outs), run through ``ModelRunner.execute`` from a mixed-step
CUDA graph with per-group swap-in waits (the runner's way). Each phase of the host's work is
timed with ``time.perf_counter`` around the runner's own calls (medians of ``--iters``):

- ``fill``: the step's inputs into the graph's buffers (``MixedGraphs.fill``);
- ``swap_in`` / ``swap_out``: issuing the staged swap-ins (by groups of layers) and the
  background swap-outs (inside ``KVSwapper.start_step``); ``start_step``: all of it;
- ``arm``: the graph's per-group waits re-recorded after the swapper's events;
- ``replay``: the graph launch;
- ``issue``: the runner's host time until the forward was issued (``host_issue_s``);
- ``step``: wall time to the sampled ids on the host, from an idle device.

for each ``--groups`` (``PENSIEVE_SWAP_IN_GROUPS``: one runner per value, its graphs
captured with that many waits). CUDA only::

    python benchmarks/step_host_phases.py --swap-in 0,64,128 --groups 8,4,2 \
        --out step_host_phases.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from step_swap_ins import add_step_args, build_step, profile_executes, step_shape

from pensieve.runner.model_runner import ModelRunner

PHASES = ("fill", "swap_in", "swap_out", "start_step", "arm", "replay", "issue", "step")


def timed(times: dict[str, list[float]], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` that appends its wall time (ms) to ``times[name]``, summed within one step."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[name][-1] += (time.perf_counter() - t) * 1e3
    return wrapper


def instrument(runner: ModelRunner, times: dict[str, list[float]]) -> Callable[[], None]:
    """Wrap the runner's calls of each phase (instance attributes over the methods); returns
    the function that removes the wrappers."""
    sw, mixed = runner.swapper, runner.mixed_graphs
    assert mixed is not None and mixed.layer_waits is not None
    wrapped = [(sw, "start_step", "start_step"), (sw, "_issue_in_staged", "swap_in"),
               (sw, "_issue_out_staged", "swap_out"), (mixed, "fill", "fill"),
               (mixed, "replay", "replay"), (mixed.layer_waits, "arm", "arm")]
    for obj, attr, phase in wrapped:
        setattr(obj, attr, timed(times, phase, getattr(obj, attr)))

    def restore() -> None:
        for obj, attr, _ in wrapped:
            delattr(obj, attr)
    return restore


def measure(runner: ModelRunner, sched: Any, iters: int) -> dict[str, float]:
    times: dict[str, list[float]] = defaultdict(list)
    restore = instrument(runner, times)
    graphs_before = runner.num_mixed_graph_steps
    for i in range(iters + 3):
        for p in PHASES:
            times[p].append(0.0)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = runner.execute(sched)
        times["step"][-1] = (time.perf_counter() - t) * 1e3
        times["issue"][-1] = out.host_issue_s * 1e3
        if i < 3:  # warm-up
            for p in PHASES:
                times[p].pop()
    restore()
    if runner.num_mixed_graph_steps - graphs_before != iters + 3:
        raise RuntimeError("a step did not replay a mixed-step graph")
    return {f"{p}_ms": round(statistics.median(times[p]), 3) for p in PHASES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_args(ap, 52, 2304, 288, 4096, "0,64,128")
    ap.add_argument("--groups", default="8,4,2",
                    help="PENSIEVE_SWAP_IN_GROUPS values, comma-separated")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="also print a cProfile (by cumulative time) of STEPS executes at the "
                    "first --groups value and each swap-in count")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sh = step_shape(args, "step_host_phases.py")
    su, swap_ins, cpu_blocks = sh.su, sh.swap_ins, sh.cpu_blocks
    tokens, max_blocks = sh.tokens, sh.max_blocks
    rows = []
    for groups in [int(g) for g in args.groups.split(",")]:
        os.environ["PENSIEVE_SWAP_IN_GROUPS"] = str(groups)
        runner = ModelRunner(su.model, su.kv, su.chunk, num_cpu_blocks=cpu_blocks)
        runner.enable_mixed_graphs(tokens, args.batch + 1, max_blocks)
        for n in swap_ins:
            sched = build_step(args.batch, args.ctx, args.prefill, args.history, n,
                               args.swap_out, su.chunk, su.num_blocks, cpu_blocks,
                               random.Random(n))
            if args.profile and (not rows or rows[0]["groups"] == groups):
                print(f"-- cProfile of {args.profile} steps ({groups} groups, {n} swap-ins)\n"
                      + profile_executes(runner, sched, args.profile, "cumulative", 45),
                      flush=True)
            row = {"groups": groups, "swap_in": n, "method": runner.swapper.method,
                   **measure(runner, sched, args.iters)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del runner
        torch.cuda.empty_cache()
    print("groups swap_in | " + " ".join(f"{p:>10}" for p in PHASES) + "  (ms, medians)")
    for r in rows:
        print(f"{r['groups']:>6} {r['swap_in']:>7} | "
              + " ".join(f"{r[p + '_ms']:>10.3f}" for p in PHASES))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "gpu": torch.cuda.get_device_name(),
                       "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
