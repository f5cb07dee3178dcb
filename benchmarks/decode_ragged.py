"""Decode steps over ragged contexts: the KV split rule by span against the unsplit one.

Serving ShareGPT near saturation (docs/benchmarks.md, "ShareGPT at steady state from a warm
start"), a decode step of ~56 requests took ~31 ms in the server, against ~14 ms for 64 x 2k in
``decode_step.py``. Its contexts are ragged: the requests a decode step holds (weighted by the
tokens they decode) had mean ~3.2k positions and a batch's longest ~13.7k. With that many
requests the attention grid filled the GPU unsplit, so the longest request's programs ran alone
after the others. This benchmark times whole decode steps (``ModelRunner.execute`` replaying its
CUDA graphs, as ``decode_step.py``) for uniform and ragged contexts of the same mean, with the
split span (``pensieve.kernels.launch_policy``) and without (``PENSIEVE_DECODE_SPAN=0``).

Ragged contexts: lognormal with median ``--median`` and sigma ``--sigma`` (fitted to the served
ShareGPT requests: median ~1.5k, p90 ~7.7k), clipped to [16, ``--max-ctx``]; the uniform case
puts every request at the ragged draw's mean.

    python benchmarks/decode_ragged.py --batches 32,56,96 --out decode_ragged.json \
        --plot decode_ragged.png
    python benchmarks/decode_ragged.py --batches 56 --min-splits 2    # fewer empty programs
"""

from __future__ import annotations

import argparse
import json
import os
import random

import torch
from decode_step import GREEDY, setup
from mixed_step import time_step
from tqdm import tqdm

from pensieve.core.outputs import QueryRange, ScheduledRequest, SchedulerOutput, SwapPlan
from pensieve.kernels import launch_policy
from pensieve.runner.model_runner import ModelRunner


def ragged_contexts(batch: int, median: float, sigma: float, max_ctx: int,
                    rng: random.Random) -> list[int]:
    return [max(16, min(max_ctx, int(rng.lognormvariate(0.0, sigma) * median)))
            for _ in range(batch)]


def step_for(contexts: list[int], chunk: int, rng: random.Random,
             free_blocks: list[int]) -> SchedulerOutput:
    """One decode token per request at its context, fresh random blocks."""
    rng.shuffle(free_blocks)
    reqs, used = [], 0
    for i, ctx in enumerate(contexts):
        per = ctx // chunk + 1
        table = free_blocks[used:used + per]
        used += per
        reqs.append(ScheduledRequest(f"r{i}", table, [QueryRange(ctx, [rng.randrange(1000)])],
                                     True, GREEDY, 0))
    return SchedulerOutput(requests=reqs, swaps=SwapPlan())


def graph_runner(su, max_batch: int, max_ctx: int, span: bool) -> ModelRunner:  # noqa: ANN001
    os.environ["PENSIEVE_DECODE_SPAN"] = "1" if span else "0"
    runner = ModelRunner(su.model, su.kv, su.chunk)
    runner.enable_decode_graphs(max_batch, su.graph_max_blocks(max_batch, max_ctx))
    assert runner.decode_graphs is not None and runner.decode_graphs.variants == (span,)
    return runner


def set_min_splits(n: int) -> None:
    """The span graphs' fewest KV splits (``launch_policy.DECODE_MIN_SPLITS``, read when a
    graph is captured): fewer splits launch fewer programs that exit at once, for telling
    the span's cost on uniform steps apart from the grid order."""
    if not 1 <= n <= launch_policy.MAX_SPLITS:
        raise ValueError(f"--min-splits must be in [1, {launch_policy.MAX_SPLITS}], got {n}")
    launch_policy.DECODE_MIN_SPLITS = n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama2-13b-gqa10")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="32,56,96")
    ap.add_argument("--median", type=float, default=1500.0)
    ap.add_argument("--sigma", type=float, default=1.23)
    ap.add_argument("--max-ctx", type=int, default=16000)
    ap.add_argument("--draws", type=int, default=3, help="ragged batches drawn per size")
    ap.add_argument("--kv-gb", type=float, default=60.0)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--min-splits", type=int, default=launch_policy.DECODE_MIN_SPLITS,
                    help="the span graphs' fewest KV splits (default: the engine's)")
    args = ap.parse_args(argv)
    try:
        set_min_splits(args.min_splits)
    except ValueError as e:
        ap.error(str(e))

    su = setup(args.model, getattr(torch, args.dtype), args.kv_gb, torch.device("cuda"))
    batches = [int(b) for b in args.batches.split(",")]
    runners = {False: graph_runner(su, max(batches), args.max_ctx, False),
               True: graph_runner(su, max(batches), args.max_ctx, True)}
    rng = random.Random(0)
    free = list(range(su.num_blocks))
    rows = []
    cases = [(b, d) for b in batches for d in range(args.draws)]
    for batch, draw in tqdm(cases, desc="decode batches"):
        ragged = ragged_contexts(batch, args.median, args.sigma, args.max_ctx, rng)
        mean = sum(ragged) // batch
        for kind, ctxs in (("uniform", [mean] * batch), ("ragged", ragged)):
            if sum(c // su.chunk + 1 for c in ctxs) > su.num_blocks:
                continue
            sched = step_for(ctxs, su.chunk, rng, free)
            floor = su.floor_ms(batch, mean)
            row = {"batch": batch, "draw": draw, "contexts": kind, "mean_ctx": mean,
                   "max_ctx": max(ctxs), "floor_ms": round(floor, 3)}
            for span, runner in runners.items():
                key = "span" if span else "unsplit"
                row[f"{key}_ms"] = round(time_step(runner, sched, args.iters), 3)
                row[f"{key}_x_floor"] = round(row[f"{key}_ms"] / floor, 2)
            rows.append(row)
            tqdm.write(json.dumps(row))

    hdr = ("batch", "contexts", "mean_ctx", "max_ctx", "floor_ms", "unsplit_ms", "span_ms",
           "unsplit_x_floor", "span_x_floor")
    print(" | ".join(hdr))
    for r in rows:
        print(" | ".join(str(r[h]) for h in hdr))
    result = {"model": args.model, "dtype": args.dtype, "gpu": torch.cuda.get_device_name(),
              "min_splits": args.min_splits,
              "median": args.median, "sigma": args.sigma, "max_ctx": args.max_ctx, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        plot(rows, args.plot)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, kind in zip(axes, ("uniform", "ragged")):
        rs = [r for r in rows if r["contexts"] == kind]
        for key, style in (("floor_ms", "k_"), ("unsplit_ms", "o"), ("span_ms", "s")):
            ax.plot([r["batch"] for r in rs], [r[key] for r in rs], style, label=key[:-3])
        ax.set_title(f"{kind} contexts")
        ax.set_xlabel("decode batch")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("decode step (ms)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
