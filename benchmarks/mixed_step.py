"""What prefill tokens add to a step: decode-only steps against the same decodes plus a prefill.

Each configuration is ``batch`` decoding requests at context ``ctx`` (one token each), alone and
together with one new turn of ``prefill`` tokens over a conversation that already holds
``history`` tokens of KV (a continued conversation: the new tokens attend to the history and to
themselves). Three ways to run the mixed step are timed through ``ModelRunner.execute`` (the
engine's own path: inputs, forward, LM head, sampling, the host's wait for the ids):

- ``decode``: the decode-only step, replayed from the decode CUDA graphs (the baseline);
- ``mixed_eager``: the mixed step run eagerly (what the engine does without mixed graphs);
- ``mixed_graph``: the mixed step replayed from the mixed-step CUDA graphs (``MixedGraphs``),
  where it fits their token bound (``MIXED_GRAPH_MAX_TOKENS``; beyond it the engine runs the
  step eagerly).

``extra_*`` is the mixed step minus the decode step. The prefill's own GEMM floor
(``2 * params * prefill / peak``) is printed beside it: the extra time can not go below that.

    python benchmarks/mixed_step.py --model llama2-13b-gqa10 --out mixed_step.json \
        --plot mixed_step.png
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from decode_step import decode_step, setup
from tqdm import tqdm

from pensieve.core.outputs import QueryRange, ScheduledRequest, SchedulerOutput, SwapPlan
from pensieve.core.sampling_params import SamplingParams
from pensieve.runner.model_runner import ModelRunner

GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
PEAK_TFLOPS = 790.0
"""bf16 dense matmul rate measured on the H200 (the brief's ~790-810 TFLOP/s)."""


def mixed_step(dec: SchedulerOutput, prefill: int, history: int, chunk: int,
               rng: random.Random, blocks: list[int]) -> SchedulerOutput:
    """``dec`` plus one request computing ``prefill`` new tokens after ``history`` cached."""
    n = (history + prefill) // chunk + 1
    table = blocks[:n]
    ids = [rng.randrange(1000) for _ in range(prefill)]
    new = ScheduledRequest("prefill", table, [QueryRange(history, ids)], True, GREEDY, 0)
    return SchedulerOutput(requests=[*dec.requests, new], swaps=SwapPlan())


def time_step(runner: ModelRunner, sched: SchedulerOutput, iters: int) -> float:
    for _ in range(3):
        runner.execute(sched)
    walls = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        runner.execute(sched)  # ends with the host waiting for the sampled ids
        walls.append(time.perf_counter() - t)
    return statistics.median(walls) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama2-13b-gqa10")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--configs", default="8x2048,32x2048,64x2048,128x2048,32x4096",
                    help="BATCHxCTX of the decodes")
    ap.add_argument("--prefills", default="16,32,64,128,256,320,480,1024",
                    help="new tokens of the turn")
    ap.add_argument("--history", type=int, default=2048, help="cached tokens before the turn")
    ap.add_argument("--max-tokens", type=int, default=2048,
                    help="the mixed graphs' token bound (the engine's max_num_batched_tokens)")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--kv-gb", type=float, default=40.0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()

    device = torch.device("cuda")
    su = setup(args.model, getattr(torch, args.dtype), args.kv_gb, device)
    chunk = su.chunk
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    prefills = [int(p) for p in args.prefills.split(",")]
    max_batch = max(b for b, _ in configs) + 1
    max_blocks = args.max_model_len // chunk
    params = sum(p.numel() for p in su.model.parameters())

    eager = ModelRunner(su.model, su.kv, chunk)
    eager.enable_decode_graphs(max_batch, max_blocks)
    graphs = ModelRunner(su.model, su.kv, chunk)
    t0 = time.perf_counter()
    graphs.enable_decode_graphs(max_batch, max_blocks)
    graphs.enable_mixed_graphs(args.max_tokens, max_batch, max_blocks)
    capture_s = time.perf_counter() - t0
    print(f"captured decode + mixed graphs in {capture_s:.1f} s")

    rng = random.Random(0)
    free = list(range(su.num_blocks))
    rows = []
    for (batch, ctx), prefill in tqdm([(c, p) for c in configs for p in prefills],
                                      desc="mixed-step configs"):
        need = batch * (ctx // chunk + 1) + (args.history + prefill) // chunk + 1
        if need > su.num_blocks or batch + 1 > max_batch or batch + prefill > args.max_tokens:
            rows.append({"batch": batch, "ctx": ctx, "prefill": prefill, "skipped": "too big"})
            continue
        dec = decode_step(batch, ctx, chunk, rng, free)
        used = {b for s in dec.requests for b in s.block_table}
        mixed = mixed_step(dec, prefill, args.history, chunk, rng,
                           [b for b in free if b not in used])
        assert graphs.decode_graphs is not None and graphs.decode_graphs.can_run(dec)
        assert graphs.mixed_graphs is not None
        fits = graphs.mixed_graphs.can_run(mixed)  # else the engine runs it eagerly
        row = {"batch": batch, "ctx": ctx, "prefill": prefill, "history": args.history}
        row["decode_ms"] = round(time_step(graphs, dec, args.iters), 3)
        row["mixed_eager_ms"] = round(time_step(eager, mixed, args.iters), 3)
        row["extra_eager_ms"] = round(row["mixed_eager_ms"] - row["decode_ms"], 3)
        row["mixed_graph_ms"] = row["extra_graph_ms"] = None
        if fits:
            before = graphs.num_mixed_graph_steps
            row["mixed_graph_ms"] = round(time_step(graphs, mixed, args.iters), 3)
            assert graphs.num_mixed_graph_steps > before, "mixed step did not replay a graph"
            row["extra_graph_ms"] = round(row["mixed_graph_ms"] - row["decode_ms"], 3)
        row["prefill_gemm_floor_ms"] = round(2 * params * prefill / (PEAK_TFLOPS * 1e12) * 1e3,
                                             3)
        rows.append(row)
        tqdm.write(json.dumps(row))

    hdr = ("batch", "ctx", "prefill", "decode_ms", "mixed_eager_ms", "mixed_graph_ms",
           "extra_eager_ms", "extra_graph_ms", "prefill_gemm_floor_ms")
    print(" | ".join(hdr))
    for r in rows:
        if "skipped" not in r:
            print(" | ".join(str(r[h]) for h in hdr))
    result = {"model": args.model, "dtype": args.dtype, "gpu": torch.cuda.get_device_name(),
              "capture_s": round(capture_s, 1), "max_tokens": args.max_tokens, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        shown = [c for c in configs
                 if any(r["batch"] == c[0] and r["ctx"] == c[1] and "skipped" not in r
                        for r in rows)]
        fig, axes = plt.subplots(1, len(shown), figsize=(4.5 * len(shown), 4), sharey=True,
                                 squeeze=False)
        axes = axes[0]
        for ax, (batch, ctx) in zip(axes, shown):
            rs = [r for r in rows if r["batch"] == batch and r["ctx"] == ctx
                  and "skipped" not in r]
            for key, style in (("extra_eager_ms", "o-"), ("extra_graph_ms", "s-"),
                               ("prefill_gemm_floor_ms", "k--")):
                pts = [(r["prefill"], r[key]) for r in rs if r[key] is not None]
                ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=key)
            ax.axhline(3.0, color="r", lw=0.8, ls=":", label="target +3 ms")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{batch} decodes at {ctx}")
            ax.set_xlabel("prefill tokens in the step")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("mixed step - decode step (ms)")
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{args.model} {args.dtype}: cost of prefill tokens in a step")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
