"""Host time to write a step's inputs into the CUDA graphs' static buffers (CPU).

Before a graph replay the runner fills pinned host buffers from the scheduler's output
(``MixedGraphs.fill`` for steps with prefill tokens, ``DecodeGraphs.fill`` for decode-only
steps); the device idles meanwhile, since the previous step ended by reading its sampled ids.
This times both fills on the CPU, the buffers' copy to the device left out (on the CPU it is a
memcpy, on CUDA an asynchronous copy the host does not wait for), for steps like ShareGPT's
under churn: ``B`` decodes at contexts drawn as ``decode_ragged.py`` draws them (lognormal,
max 16,000) plus, for the mixed step, one turn of ``--prefill`` new tokens after ``--history``
cached ones; chunks of 32 tokens, 256 range slots and 512 blocks a request (what
``pensieve serve`` captures with a 16k context), 13B GQA-10's head counts. Medians over
``--reps`` rounds of ``--iters`` fills::

    python benchmarks/graph_fill_host.py --out graph_fill_host.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from pensieve.core.outputs import QueryRange, ScheduledRequest, SchedulerOutput  # noqa: E402
from pensieve.core.sampling_params import SamplingParams  # noqa: E402

CHUNK, MAX_RANGES, MAX_BLOCKS, NUM_BLOCKS = 32, 256, 512, 20_000


def _runner(path: str):  # noqa: ANN202
    import transformers

    from pensieve.models.loader import load_model
    from pensieve.runner.model_runner import ModelRunner, allocate_kv_caches

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=640, intermediate_size=128,
                                   num_hidden_layers=1, num_attention_heads=40,
                                   num_key_value_heads=10, max_position_embeddings=16384)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    model, _ = load_model(path, dtype=torch.float32, device=torch.device("cpu"))
    kv = allocate_kv_caches(1, NUM_BLOCKS, CHUNK, 10, 16, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, kv, CHUNK, num_cpu_blocks=0)
    runner.enable_mixed_graphs(512, MAX_RANGES, MAX_BLOCKS, capture=False)
    runner.enable_decode_graphs(MAX_RANGES, MAX_BLOCKS, capture=False)
    for g in (runner.mixed_graphs, runner.decode_graphs):
        g._copy_in = lambda non_blocking=True: None  # the device copy is not host work here
    return runner


def _steps(batch: int, prefill: int, history: int, seed: int
           ) -> tuple[SchedulerOutput, SchedulerOutput]:
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0)

    def req(rid: str, ctx: int, n: int) -> ScheduledRequest:
        table = tuple(rng.randrange(NUM_BLOCKS) for _ in range(ctx // CHUNK + 1))
        return ScheduledRequest(
            request_id=rid, block_table=table,
            ranges=[QueryRange(ctx - n, [rng.randrange(128) for _ in range(n)])],
            sample=True, sampling_params=params, num_output_tokens=0)

    ctxs = [min(16_000, int(rng.lognormvariate(7.6, 0.9))) + 2 for _ in range(batch)]
    decodes = [req(f"d{i}", c, 1) for i, c in enumerate(ctxs)]
    return (SchedulerOutput(requests=decodes),
            SchedulerOutput(requests=[*decodes, req("p", history + prefill, prefill)]))


def _time(fill, sched: SchedulerOutput, iters: int, reps: int) -> float:  # noqa: ANN001
    for _ in range(20):
        fill(sched)
    rounds = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(iters):
            fill(sched)
        rounds.append((time.perf_counter() - t) / iters * 1e3)
    return statistics.median(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="32,56,128,200",
                    help="decodes a step (with --prefill, at most 512 tokens)")
    ap.add_argument("--prefill", type=int, default=290)
    ap.add_argument("--history", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runner = _runner(tmp)
        rows = []
        for batch in (int(b) for b in args.batches.split(",")):
            decode, mixed = _steps(batch, args.prefill, args.history, seed=batch)
            row = {"decodes": batch, "prefill_tokens": args.prefill,
                   "decode_fill_ms": _time(runner.decode_graphs.fill, decode, args.iters,
                                           args.reps),
                   "mixed_fill_ms": _time(runner.mixed_graphs.fill, mixed, args.iters,
                                          args.reps),
                   "mixed_decodes": runner.mixed_decodes}
            rows.append(row)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                              for k, v in row.items()}))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
