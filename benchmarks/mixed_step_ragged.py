"""What prefill tokens add to a step when the step's decode contexts are ragged.

A decode-only step of ragged contexts splits its KV by span (``PENSIEVE_DECODE_SPAN=auto``,
docs/performance.md, "Decode over ragged contexts"); in a step with prefill tokens the same
decodes went through the mixed-step kernel, unsplit, until ``PENSIEVE_MIXED_DECODES=split``
(now the default) gave them a launch of their own. This times, through
``ModelRunner.execute`` from CUDA graphs, ``--batch`` decodes alone (decode graphs) and with
one turn of P new tokens after ``--history`` cached ones (mixed-step graphs), for contexts
drawn as ``decode_ragged.py`` draws them (lognormal, ShareGPT's fit) and for the same number
of decodes at their mean (uniform). ``extra`` = mixed step - decode step. ``--decodes``: the
runners' ``PENSIEVE_MIXED_DECODES`` (``together``: the decodes in the mixed-step kernel;
``split``, the engine's default: in a decode launch of their own, split by span where ragged), one
runner each. ``--history`` may list several lengths (``512,1792,4096,8192``): the turn's
attention over its history, which the mixed-step graphs split over KV by a span set per step
unless ``PENSIEVE_MIXED_SPLITS=0`` (columns ``mixed_P_hH_ms`` / ``extra_P_hH_ms`` then)::

    python benchmarks/mixed_step_ragged.py --out mixed_step_ragged.json
    python benchmarks/mixed_step_ragged.py --prefills 24 --history 512,1792,4096,8192 \
        --decodes split --draws 1 --out mixed_step_history.json
"""

from __future__ import annotations

import argparse
import json
import os
import random

import torch
from decode_ragged import ragged_contexts, step_for
from decode_step import setup
from mixed_step import mixed_step, time_step

from pensieve.runner.model_runner import ModelRunner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama2-13b-gqa10")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=56)
    ap.add_argument("--prefills", default="16,160")
    ap.add_argument("--history", default="1792",
                    help="cached tokens before the turn; a comma list times each")
    ap.add_argument("--median", type=float, default=1500.0)
    ap.add_argument("--sigma", type=float, default=1.23)
    ap.add_argument("--max-ctx", type=int, default=16000)
    ap.add_argument("--draws", type=int, default=2)
    ap.add_argument("--kv-gb", type=float, default=60.0)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--decodes", default="together,split")
    ap.add_argument("--max-ranges", type=int, default=None,
                    help="range slots of the mixed-step graphs (default: batch + 1; "
                    "pensieve serve captures 256)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    su = setup(args.model, getattr(torch, args.dtype), args.kv_gb, torch.device("cuda"))
    prefills = [int(p) for p in args.prefills.split(",")]
    histories = [int(h) for h in args.history.split(",")]
    cases = [(p, h) for h in histories for p in prefills]

    def key(p: int, h: int) -> str:
        return f"{p}_h{h}" if len(histories) > 1 else str(p)

    max_blocks = max(args.max_ctx, max(histories) + max(prefills)) // su.chunk + 2
    runners = {}
    for mode in args.decodes.split(","):
        os.environ["PENSIEVE_MIXED_DECODES"] = mode  # read when the runner is built
        runner = runners[mode] = ModelRunner(su.model, su.kv, su.chunk)
        runner.enable_decode_graphs(args.batch + 1, max_blocks)
        runner.enable_mixed_graphs(args.batch + max(prefills), args.max_ranges or args.batch + 1,
                                   max_blocks)
    rng = random.Random(0)
    free = list(range(su.num_blocks))
    rows = []
    for draw in range(args.draws):
        ragged = ragged_contexts(args.batch, args.median, args.sigma, args.max_ctx, rng)
        mean = sum(ragged) // args.batch
        for kind, ctxs in (("uniform", [mean] * args.batch), ("ragged", ragged)):
            dec = step_for(ctxs, su.chunk, rng, free)
            used = {b for s in dec.requests for b in s.block_table}
            rest = [b for b in free if b not in used]
            mixed = {(p, h): mixed_step(dec, p, h, su.chunk, rng, rest) for p, h in cases}
            for mode, runner in runners.items():
                row = {"decodes": mode, "draw": draw, "contexts": kind, "mean_ctx": mean,
                       "max_ctx": max(ctxs),
                       "decode_ms": round(time_step(runner, dec, args.iters), 3)}
                for p, h in cases:
                    before = runner.num_mixed_graph_steps
                    ms = time_step(runner, mixed[p, h], args.iters)
                    assert runner.num_mixed_graph_steps > before, "no mixed graph replayed"
                    row[f"mixed_{key(p, h)}_ms"] = round(ms, 3)
                    row[f"extra_{key(p, h)}_ms"] = round(ms - row["decode_ms"], 3)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "gpu": torch.cuda.get_device_name(),
                       "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
