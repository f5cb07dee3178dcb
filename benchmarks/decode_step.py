"""Decode step time against the HBM floor, eager and replayed from CUDA graphs.

A decode step of ``batch`` requests at context ``ctx`` must read every weight once and the K/V
of every cached token: ``floor = (weight bytes + batch * ctx * kv bytes per token) / 4.3 TB/s``
(the measured device copy bandwidth). The step is timed through ``ModelRunner.execute`` with a
hand-built :class:`SchedulerOutput` (the same object the scheduler emits), so the time includes
building inputs, the forward pass, the LM head and greedy sampling, and the host's wait for the
token ids. Distinct KV blocks per request (random ids), dummy weights.

    python benchmarks/decode_step.py --model llama2-13b-gqa10 --out decode_step.json \
        --plot decode_step.png

Host time of a step (``host_ms``) is the time until the step's last kernel is enqueued;
``gpu_ms`` is CUDA-event time of the whole step on the compute stream.
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
from tqdm import tqdm

from pensieve.config import EngineConfig, ModelConfig
from pensieve.core.outputs import QueryRange, ScheduledRequest, SchedulerOutput, SwapPlan
from pensieve.core.sampling_params import SamplingParams
from pensieve.engine.kv_layout import KVLayout
from pensieve.models.loader import load_model, resolve_config
from pensieve.runner.model_runner import ModelRunner

HBM_TBPS = 4.3
GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def decode_step(batch: int, ctx: int, chunk: int, rng: random.Random,
                free_blocks: list[int]) -> SchedulerOutput:
    """One decode token per request at position ``ctx`` with fresh random blocks."""
    per = ctx // chunk + 1
    rng.shuffle(free_blocks)
    reqs = []
    for i in range(batch):
        table = free_blocks[i * per:(i + 1) * per]
        reqs.append(ScheduledRequest(f"r{i}", table, [QueryRange(ctx, [rng.randrange(1000)])],
                                     True, GREEDY, 0))
    return SchedulerOutput(requests=reqs, swaps=SwapPlan())


@dataclass
class Setup:
    """A dummy-weight model and its KV caches, as every decode benchmark here builds them."""

    model: torch.nn.Module
    kv: list[torch.Tensor]
    chunk: int
    num_blocks: int
    weight_bytes: int
    kv_per_token: int
    layout: KVLayout
    """The KV layout ``kv`` was allocated from."""

    def fits(self, batch: int, ctx: int) -> bool:
        """Whether ``batch`` requests of ``ctx`` tokens get distinct blocks."""
        return batch * (ctx // self.chunk + 1) <= self.num_blocks

    def floor_ms(self, batch: int, ctx: int) -> float:
        """HBM floor of a decode step: every weight once, the K/V of ``ctx + 1`` tokens."""
        return hbm_floor_ms(self.weight_bytes, self.kv_per_token, batch, ctx)

    def graph_max_blocks(self, max_batch: int, max_ctx: int) -> int:
        """Block-table width of the decode graphs: the engine's (on CUDA), or ``max_ctx``'s."""
        shape = EngineConfig(model=ModelConfig(cuda_graph_max_batch=max_batch)).decode_graph_shape(
            self.kv[0].device.type)
        need = max_ctx // self.chunk + 1
        return need if shape is None else max(shape[1], need)


def hbm_floor_ms(weight_bytes: int, kv_per_token: int, batch: int, ctx: int) -> float:
    return (weight_bytes + batch * (ctx + 1) * kv_per_token) / (HBM_TBPS * 1e12) * 1e3


def setup(model_name: str, dtype: torch.dtype, kv_gb: float, device: torch.device,
          chunk: int = 32) -> Setup:
    """Load ``model_name`` (preset, ``demo`` or a directory) with dummy weights and allocate
    ``kv_gb`` GiB of KV cache filled with random values."""
    hf_config, path = resolve_config(model_name)
    model, hf_config = load_model(path or hf_config, dtype=dtype, device=device,
                                  load_format="dummy", seed=0)
    layout = KVLayout(model.num_layers, model.num_kv_heads, model.head_dim, chunk, dtype)
    block_bytes = layout.block_bytes
    num_blocks = int(kv_gb * 2**30 // block_bytes)
    kv = layout.allocate(num_blocks, device)
    for t in kv:
        t.normal_(0, 0.5)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return Setup(model, kv, chunk, num_blocks, weight_bytes, block_bytes // chunk, layout)


def build_parser() -> argparse.ArgumentParser:
    """The command line's options."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama2-13b-gqa10")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--kv-gb", type=float, default=90.0, help="KV cache size; configs whose "
                    "KV does not fit are skipped")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    return ap


def time_mode(name: str, runner: ModelRunner, sched: Any, su: Setup, iters: int,
              floor_ms: float) -> dict[str, float]:
    """Median wall and GPU time of ``iters`` steps through ``runner`` (after 3 warm-up steps),
    and the host's enqueue time of the forward alone, for one config; keys prefixed by
    ``name``."""
    for _ in range(3):
        runner.execute(sched)
    walls, gpus = [], []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
            enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        t = time.perf_counter()
        runner.execute(sched)  # ends with the host waiting for the sampled ids
        end.record()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
        gpus.append(start.elapsed_time(end) / 1e3)
    # Host time: the enqueue time of the forward alone (no sync), once per config.
    torch.cuda.synchronize()
    t = time.perf_counter()
    if name == "graph":
        runner.decode_graphs.run(sched)
    else:
        inp = runner.prepare_inputs(sched)
        h = su.model(inp.input_ids, inp.positions, su.kv, inp.attn)
        su.model.compute_logits(h[inp.logits_indices])
    enqueue = time.perf_counter() - t
    torch.cuda.synchronize()
    med = statistics.median(walls)
    return {f"{name}_ms": round(med * 1e3, 3),
            f"{name}_gpu_ms": round(statistics.median(gpus) * 1e3, 3),
            f"{name}_host_ms": round(enqueue * 1e3, 3),
            f"{name}_x_floor": round(med * 1e3 / floor_ms, 2)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    su = setup(args.model, dtype, args.kv_gb, device)
    model, kv, chunk, num_blocks = su.model, su.kv, su.chunk, su.num_blocks
    weight_bytes, kv_per_token = su.weight_bytes, su.kv_per_token
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    max_blocks = su.graph_max_blocks(max(batches), max(contexts))

    eager = ModelRunner(model, su.layout, kv)
    graphs = ModelRunner(model, su.layout, kv)
    t0 = time.perf_counter()
    graphs.enable_decode_graphs(max(batches), max_blocks)
    capture_s = time.perf_counter() - t0
    print(f"captured {len(graphs.decode_graphs.buckets)} graphs in {capture_s:.1f} s")

    rng = random.Random(0)
    free = list(range(num_blocks))
    rows = []
    configs = [(b, c) for c in contexts for b in batches]
    for batch, ctx in tqdm(configs, desc="decode configs"):
        if not su.fits(batch, ctx):
            rows.append({"batch": batch, "ctx": ctx, "skipped": "KV does not fit"})
            continue
        floor_ms = su.floor_ms(batch, ctx)
        row = {"batch": batch, "ctx": ctx, "floor_ms": round(floor_ms, 3)}
        for name, runner in (("eager", eager), ("graph", graphs)):
            sched = decode_step(batch, ctx, chunk, rng, free)
            row.update(time_mode(name, runner, sched, su, args.iters, floor_ms))
        row["speedup"] = round(row["eager_ms"] / row["graph_ms"], 2)
        rows.append(row)
        tqdm.write(json.dumps(row))

    hdr = ("batch", "ctx", "floor_ms", "eager_ms", "graph_ms", "graph_x_floor", "eager_host_ms",
           "graph_host_ms", "speedup")
    print(" | ".join(hdr))
    for r in rows:
        if "skipped" in r:
            print(f"{r['batch']} | {r['ctx']} | skipped: {r['skipped']}")
        else:
            print(" | ".join(str(r[h]) for h in hdr))
    result = {"model": args.model, "dtype": args.dtype, "gpu": torch.cuda.get_device_name(),
              "weight_gb": round(weight_bytes / 1e9, 2), "kv_bytes_per_token": kv_per_token,
              "hbm_tbps": HBM_TBPS, "capture_s": round(capture_s, 1), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        plot(rows, contexts, args)
    return 0


def plot(rows: list[dict], contexts: list[int], args: argparse.Namespace) -> None:
    """Eager and graph step times against the HBM floor, one panel per context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4), sharey=True)
    for ax, ctx in zip(axes if len(contexts) > 1 else [axes], contexts):
        rs = [r for r in rows if r["ctx"] == ctx and "skipped" not in r]
        xs = [r["batch"] for r in rs]
        for key, style in (("floor_ms", "k--"), ("eager_ms", "o-"), ("graph_ms", "s-")):
            ax.plot(xs, [r[key] for r in rs], style, label=key[:-3])
        ax.set_xscale("log", base=2)
        ax.set_title(f"context {ctx}")
        ax.set_xlabel("batch (requests)")
        ax.grid(alpha=0.3)
    (axes[0] if len(contexts) > 1 else axes).set_ylabel("decode step (ms)")
    (axes[0] if len(contexts) > 1 else axes).legend()
    fig.suptitle(f"{args.model} {args.dtype} decode step vs HBM floor")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
