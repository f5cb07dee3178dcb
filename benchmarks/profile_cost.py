"""Profile the chunk recompute cost ``Cost(l)`` of a model on this device and save it as JSON.

Loads the model (a preset with ``--load-format dummy`` needs no files), times the full forward
of one chunk of ``--chunk-size`` query tokens at each context length (see
:mod:`pensieve.runner.profiler`), writes ``<out-dir>/<profile_key>.json`` (the file the engine
looks up by model shape and device), prints a table against the analytic roofline estimate and,
if matplotlib is installed, saves ``<out-dir>/cost_<profile_key>.png``.

    python benchmarks/profile_cost.py --model llama2-13b-gqa10 --load-format dummy \
        --dtype bfloat16 --chunks-per-batch 16 --out-dir src/pensieve/profiles

The profiler allocates KV for ``--chunks-per-batch`` requests of the longest context: at
131,072 positions that is 16 GiB a request for an 8B model in bf16, so long contexts take
fewer chunks per batch (``--context-lens`` up to 32,768 with 8 chunks: 33 GB); the engine
extrapolates the attention part linearly beyond the last length.
"""

from __future__ import annotations

import argparse
import os

import torch

from pensieve.core.cost_model import DEFAULT_CONTEXT_LENS, CostModel
from pensieve.models.loader import load_model
from pensieve.runner.profiler import analytic_cost_model, config_profile_key, profile_cost

DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
    "fp16": torch.float16, "half": torch.float16, "float32": torch.float32,
    "fp32": torch.float32, "float": torch.float32,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="llama2-13b-gqa10", help="preset name or model directory")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cpu, ...")
    ap.add_argument("--chunk-size", type=int, default=32)
    ap.add_argument("--context-lens", default=",".join(map(str, DEFAULT_CONTEXT_LENS)),
                    help="comma-separated context lengths to time")
    ap.add_argument("--chunks-per-batch", type=int, default=1,
                    help="time B one-chunk requests per forward and divide by B (amortises the "
                         "weight reads as inside a real batch)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out-dir", default="profiles")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = DTYPES[args.dtype]
    lens = [int(x) for x in args.context_lens.split(",") if x.strip()]

    model, hf_config = load_model(args.model, dtype=dtype, device=device,
                                  load_format=args.load_format)
    cost = profile_cost(model, chunk_size=args.chunk_size, context_lens=lens, device=device,
                        chunks_per_batch=args.chunks_per_batch, warmup=args.warmup,
                        iters=args.iters)
    key = cost.model_key or config_profile_key(hf_config, device)
    path = os.path.join(args.out_dir, f"{key}.json")
    cost.save(path)
    analytic = analytic_cost_model(hf_config, args.chunk_size, dtype, context_lens=lens)

    print(f"model {args.model}  device {cost.device}  dtype {cost.dtype}  chunk {cost.chunk_size}"
          f"  chunks/batch {args.chunks_per_batch}")
    print(f"c (other_s) = {cost.other_s * 1e3:.3f} ms measured, "
          f"{analytic.other_s * 1e3:.3f} ms analytic (FLOPs only)")
    print(f"{'context':>8} {'measured ms':>12} {'attention ms':>13} {'cost ms':>9} "
          f"{'analytic ms':>12}")
    for i, ctx in enumerate(cost.context_lens):
        print(f"{ctx:>8} {cost.measured_s[i] * 1e3:>12.3f} {cost.attention_s[i] * 1e3:>13.3f} "
              f"{cost.chunk_cost(ctx) * 1e3:>9.3f} {analytic.chunk_cost(ctx) * 1e3:>12.3f}")
    print(f"saved {path}")
    if not args.no_plot:
        plot(cost, analytic, os.path.join(args.out_dir, f"cost_{key}.png"))


def plot(cost: CostModel, analytic: CostModel, path: str) -> None:
    """Measured points, the interpolation (and extrapolation) line, the analytic model."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    hi = int(cost.context_lens[-1] * 1.15) + cost.chunk_size
    grid = [hi * i // 200 for i in range(201)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(grid, [cost.chunk_cost(x) * 1e3 for x in grid], "-", label="interpolated Cost(l)")
    ax.plot(cost.context_lens, [t * 1e3 for t in cost.measured_s], "o", label="measured")
    ax.plot(grid, [analytic.chunk_cost(x) * 1e3 for x in grid], "--",
            label="analytic (roofline, weights amortised)")
    ax.axhline(cost.other_s * 1e3, color="gray", lw=0.8, ls=":", label="c (non-attention)")
    ax.set_xlabel("context length l (tokens before the chunk)")
    ax.set_ylabel(f"time to recompute one {cost.chunk_size}-token chunk (ms)")
    ax.set_title(f"{cost.model_key}")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
