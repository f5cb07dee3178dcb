"""Steps with prefill and swap-ins through the runner: how each way of running them costs.

A ShareGPT-like step with prefill (``--batch`` decodes at ``--ctx`` plus one turn of
``--prefill`` new tokens after ``--history`` cached ones) whose first N history chunks come
from the CPU tier in the same step (random CPU block ids), beside ``--swap-out`` chunks of
background swap-outs issued by the same step. Each way is timed through
``ModelRunner.execute`` (wall time to the sampled ids on the host, and the runner's host
issue time; medians of ``--iters``):

- ``eager``: the step run eagerly, each layer waiting for its group of swap-ins;
- ``graph_all``: replayed from a mixed-step CUDA graph after waiting for every swap-in (the
  runner's way, before per-group waits, for steps of at most ``graph_max_swap_in`` chunks);
- ``graph_groups``: replayed from a mixed-step CUDA graph that waits per group of layers
  (:mod:`pensieve.runner.graph_waits`, the runner's way now);

each with the step's input uploads issued before its swaps (``inputs_first``, the runner's
order now) or after them (``swaps_first``, the order before: the swaps are issued, then
``execute`` runs with them already issued), and for ``eager`` also with ``PENSIEVE_HOST_IO=
mapped`` (inputs and ids through mapped host arrays). CUDA only::

    python benchmarks/step_swap_ins.py --out step_swap_ins.json --plot step_swap_ins.png
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from decode_step import Setup, decode_step, setup
from host_profile import profile_calls
from mixed_step import mixed_step

from pensieve.core.outputs import SchedulerOutput, SwapPlan
from pensieve.runner.host_io import MappedReadback, StepUploads
from pensieve.runner.model_runner import ModelRunner

WAYS = ("eager", "graph_all", "graph_groups")
ORDERS = ("inputs_first", "swaps_first")


def build_step(batch: int, ctx: int, prefill: int, history: int, swap_in: int,
               swap_out: int, chunk: int, num_blocks: int, cpu_blocks: int,
               rng: random.Random) -> SchedulerOutput:
    """The step: the turn's first ``swap_in`` history chunks from random CPU blocks, and
    ``swap_out`` other GPU blocks to other random CPU blocks in the background."""
    free = list(range(num_blocks))
    dec = decode_step(batch, ctx, chunk, rng, free)
    used = {b for s in dec.requests for b in s.block_table}
    rest = [b for b in free if b not in used]
    step = mixed_step(dec, prefill, history, chunk, rng, rest)
    table = step.requests[-1].block_table
    spare = [b for b in rest if b not in set(table)]
    cpu = rng.sample(range(cpu_blocks), swap_in + swap_out)
    return SchedulerOutput(requests=step.requests, swaps=SwapPlan(
        swap_in=[(cpu[c], table[c]) for c in range(swap_in)],
        swap_out=[(spare[i], cpu[swap_in + i]) for i in range(swap_out)]))


class Way:
    """Sets the runner up for one way of running the step, and back."""

    def __init__(self, runner: ModelRunner, way: str, mapped: bool) -> None:
        self.runner, self.way, self.mapped = runner, way, mapped
        self.saved: dict[str, Any] = {}

    def __enter__(self) -> Way:
        r, mixed = self.runner, self.runner.mixed_graphs
        assert mixed is not None
        self.saved = {"mixed": mixed, "waits": mixed.layer_waits, "max": r.graph_max_swap_in,
                      "uploads": r._uploads, "readback": r._readback}
        if self.way == "eager":
            r.mixed_graphs = None
        elif self.way == "graph_all":
            mixed.layer_waits = None
            r.graph_max_swap_in = 1 << 30
        if self.mapped:
            r._uploads, r._readback = StepUploads(r.device), MappedReadback(r.device)
        return self

    def __exit__(self, *exc: object) -> None:
        r, s = self.runner, self.saved
        r.mixed_graphs = s["mixed"]
        s["mixed"].layer_waits = s["waits"]
        r.graph_max_swap_in = s["max"]
        r._uploads, r._readback = s["uploads"], s["readback"]


def run_once(runner: ModelRunner, sched: SchedulerOutput, order: str) -> tuple[float, Any]:
    """One step from an idle device: (wall ms to the ids on the host, RunnerOutput)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    if order == "swaps_first":  # the swaps issued, then the step with them already issued
        swapper = runner.swapper
        ready = swapper.start_step(sched.swaps)
        swapper.start_step = lambda plan, defer_background=False: ready  # type: ignore
        try:
            out = runner.execute(sched)
        finally:
            del swapper.start_step
    else:
        out = runner.execute(sched)
    return (time.perf_counter() - t) * 1e3, out


def measure(runner: ModelRunner, sched: SchedulerOutput, way: str, order: str, mapped: bool,
            iters: int) -> dict[str, Any]:
    with Way(runner, way, mapped):
        graphs_before = runner.num_mixed_graph_steps
        for _ in range(3):
            run_once(runner, sched, order)
        walls, issues = [], []
        for _ in range(iters):
            wall, out = run_once(runner, sched, order)
            walls.append(wall)
            issues.append(out.host_issue_s * 1e3)
        replayed = runner.num_mixed_graph_steps - graphs_before
    if (way != "eager") != (replayed == iters + 3):
        raise RuntimeError(f"{way}: {replayed} of {iters + 3} steps replayed a mixed graph")
    return {"step_ms": round(statistics.median(walls), 3),
            "host_issue_ms": round(statistics.median(issues), 3)}


def profile_executes(runner: ModelRunner, sched: SchedulerOutput, steps: int,
                     sort: str = "tottime", top: int = 30) -> str:
    """cProfile of ``steps`` calls of ``ModelRunner.execute``, each from an idle device,
    sorted by ``sort``: driver calls included."""
    return profile_calls(lambda: runner.execute(sched), steps, sort, top)


def profile_steps(runner: ModelRunner, sched: SchedulerOutput, way: str, steps: int) -> str:
    """:func:`profile_executes` of the step run ``way`` (inputs first), after a warm-up."""
    with Way(runner, way, False):
        for _ in range(3):
            run_once(runner, sched, "inputs_first")
        return profile_executes(runner, sched, steps)


@dataclass
class StepShape:
    """The model, the swap-in counts of ``--swap-in`` and what the runner needs for them."""

    su: Setup
    swap_ins: list[int]
    cpu_blocks: int
    tokens: int
    max_blocks: int


def step_shape(args: argparse.Namespace, script: str) -> StepShape:
    """Load the model of :func:`add_step_args`' arguments (CUDA only) and check them."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs CUDA (CUDA graphs and copy streams)")
    su = setup(args.model, getattr(torch, args.dtype), args.kv_gb, torch.device("cuda"))
    swap_ins = [int(x) for x in args.swap_in.split(",")]
    if max(swap_ins) * su.chunk > args.history:
        raise SystemExit(f"--history {args.history} holds fewer than {max(swap_ins)} chunks")
    return StepShape(su, swap_ins, max(swap_ins) + args.swap_out, args.batch + args.prefill,
                     (args.history + args.prefill) // su.chunk + 2)


def add_step_args(ap: argparse.ArgumentParser, batch: int, ctx: int, prefill: int,
                  history: int, swap_in: str) -> None:
    """The step's shape, with these defaults, and the model's."""
    ap.add_argument("--model", default="llama2-13b-gqa10")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--ctx", type=int, default=ctx)
    ap.add_argument("--prefill", type=int, default=prefill)
    ap.add_argument("--history", type=int, default=history)
    ap.add_argument("--swap-in", default=swap_in,
                    help="history chunks swapped in by the step, comma-separated")
    ap.add_argument("--swap-out", type=int, default=64,
                    help="background swap-out chunks the step issues")
    ap.add_argument("--kv-gb", type=float, default=40.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_args(ap, 64, 1792, 160, 8192, "0,16,64,128,256")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--ways", default=",".join(WAYS), help="comma-separated, of " + ", ".join(WAYS))
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="also print a cProfile of STEPS executes per swap-in count and way")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    ways = [w for w in args.ways.split(",") if w]
    if not ways or set(ways) - set(WAYS):
        raise SystemExit(f"--ways: a comma-separated choice of {', '.join(WAYS)}")
    sh = step_shape(args, "step_swap_ins.py")
    su, swap_ins, cpu_blocks = sh.su, sh.swap_ins, sh.cpu_blocks
    tokens, max_blocks = sh.tokens, sh.max_blocks
    runner = ModelRunner(su.model, su.kv, su.chunk, num_cpu_blocks=cpu_blocks)
    t0 = time.perf_counter()
    runner.enable_mixed_graphs(tokens, args.batch + 1, max_blocks)
    print(f"captured mixed-step graphs up to {tokens} tokens in "
          f"{time.perf_counter() - t0:.1f} s; method {runner.swapper.method}, "
          f"graph_max_swap_in {runner.graph_max_swap_in}", flush=True)
    rows = []
    for n in swap_ins:
        sched = build_step(args.batch, args.ctx, args.prefill, args.history, n, args.swap_out,
                           su.chunk, su.num_blocks, cpu_blocks, random.Random(n))
        for way in ways:
            if args.profile:
                print(f"-- cProfile of {args.profile} steps ({way}, {n} swap-ins)\n"
                      + profile_steps(runner, sched, way, args.profile), flush=True)
            for order in ORDERS:
                for mapped in ((False, True) if way == "eager" else (False,)):
                    row = {"swap_in": n, "way": way, "order": order,
                           "host_io": "mapped" if mapped else "copy",
                           **measure(runner, sched, way, order, mapped, args.iters)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    result = {"model": args.model, "gpu": torch.cuda.get_device_name(),
              "method": runner.swapper.method, "graph_max_swap_in": runner.graph_max_swap_in,
              "chunk_mb": round(runner.swapper.num_layers * runner.swapper.block_bytes / 2**20,
                                2),
              "args": vars(args), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    keys = sorted({(r["way"], r["order"], r["host_io"]) for r in rows})
    print("way / order / host I/O | " + " | ".join(f"{n} in" for n in swap_ins) + " (step ms)")
    for k in keys:
        cells = [next(r for r in rows if r["swap_in"] == n and (r["way"], r["order"],
                                                                   r["host_io"]) == k)
                 for n in swap_ins]
        print(" / ".join(k) + " | " + " | ".join(f"{c['step_ms']} ({c['host_issue_ms']})"
                                                for c in cells))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        for k in keys:
            pts = [r for r in rows if (r["way"], r["order"], r["host_io"]) == k]
            ax.plot([r["swap_in"] for r in pts], [r["step_ms"] for r in pts], "o-",
                    label=" / ".join(k))
        ax.set_xlabel("swap-in chunks of the step")
        ax.set_ylabel("step ms (to the ids on the host)")
        ax.set_title(f"{args.batch} decodes at {args.ctx} + {args.prefill} new tokens, "
                     f"{args.swap_out} swap-outs")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
