"""Offline API throughput: prefill TFLOP/s and decode HBM GB/s against the device's ceilings.

Runs ``LLM.generate`` on a batch of random prompts with ``ignore_eos`` and records every
engine step. Steps made only of one-token ranges are decode steps: their floor is the bytes
they must read (all weights once, plus the KV of every context) over the measured HBM
bandwidth. Steps without decodes are prefill steps: their FLOPs (2 x parameters x tokens plus
causal attention) over time give TFLOP/s.

    python benchmarks/offline_throughput.py --model llama2-13b-gqa10 --load-format dummy \
        --dtype bfloat16 --num-prompts 64 --prompt-len 1024 --output-len 128 --out results.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from pensieve import LLM, SamplingParams
from pensieve.options import add_engine_args, engine_options

HBM_TBPS = 4.3  # measured device copy bandwidth, read + write (brief / KINDS.md)
BF16_TFLOPS = 800.0  # measured bf16 matmul rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--out", default=None, help="write the JSON result here")
    # the engine's options from its config (pensieve.options), under this benchmark's defaults
    add_engine_args(ap, model_flag=True, defaults={
        "model": "llama2-13b-gqa10", "load_format": "dummy", "dtype": "bfloat16",
        "max_num_batched_tokens": 8192, "cuda_graph_mixed": False})
    args = ap.parse_args()

    opts = engine_options(args)
    llm = LLM(**opts)
    eng = llm.engine
    cfg = eng.hf_config
    model = eng.model
    # With tensor parallelism the driver's model lives on "meta": its shapes are the full model's.
    n_params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    tp = llm.engine.config.model.tensor_parallel_size
    emb = cfg.vocab_size * cfg.hidden_size
    matmul_params = n_params - emb  # the input embedding is a gather, not a matmul
    elem = torch.empty((), dtype=eng.dtype).element_size()
    kv_bytes_per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * elem
    attn_width = cfg.num_attention_heads * model.head_dim

    steps: list[dict] = []
    runner = eng.runner
    inner = runner.execute

    def timed(sched):  # record every step with what it computed
        out = inner(sched)
        ranges = [r for s in sched.requests for r in s.ranges]
        steps.append({
            "time": out.step_time_s,
            "tokens": sched.num_scheduled_tokens,
            "decode": all(r.query_len == 1 for r in ranges),
            "kv_tokens_read": sum(r.end_pos for r in ranges),
            "attn_pairs": sum(r.query_len * (r.start_pos + (r.query_len + 1) / 2)
                              for r in ranges),
        })
        return out

    runner.execute = timed
    engine_step = eng.step
    host: list[float] = []  # per step: engine wall time outside the runner (scheduling etc.)

    def timed_step():
        n = len(steps)
        t = time.perf_counter()
        out = engine_step()
        if len(steps) > n:
            host.append(time.perf_counter() - t - steps[-1]["time"])
        return out

    eng.step = timed_step
    rng = random.Random(0)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(args.prompt_len)]
               for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[: min(4, len(prompts))], SamplingParams(max_tokens=4, ignore_eos=True,
                                                                 temperature=0.0))  # warm-up
    steps.clear()
    host.clear()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    wall = time.perf_counter() - t0
    assert all(len(o.output_token_ids) == args.output_len for o in outs)

    pre = [s for s in steps if not s["decode"]]
    dec = [s for s in steps if s["decode"]]
    pre_time = sum(s["time"] for s in pre)
    pre_tokens = sum(s["tokens"] for s in pre)
    pre_flops = sum(2 * matmul_params * s["tokens"]
                    + 4 * model.num_layers * attn_width * s["attn_pairs"] for s in pre)
    dec_time = sum(s["time"] for s in dec)
    dec_tokens = sum(s["tokens"] for s in dec)
    dec_bytes = sum(weight_bytes + kv_bytes_per_token * s["kv_tokens_read"] for s in dec)
    full_batch = [s for s in dec if s["tokens"] == args.num_prompts]
    med = statistics.median(s["time"] for s in full_batch) if full_batch else float("nan")
    med_bytes = (statistics.median(weight_bytes + kv_bytes_per_token * s["kv_tokens_read"]
                                   for s in full_batch) if full_batch else float("nan"))
    result = {
        "model": opts["model"], "dtype": str(eng.dtype), "device": str(eng.device),
        "gpu": torch.cuda.get_device_name() if eng.device.type == "cuda" else "cpu",
        "num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
        "output_len": args.output_len, "params_b": round(n_params / 1e9, 3),
        "tensor_parallel_size": tp,
        "cuda_graphs": eng.config.decode_graph_shape(eng.device.type) is not None,
        "graph_steps": getattr(runner, "num_graph_steps", None),
        "mixed_graph_steps": getattr(runner, "num_mixed_graph_steps", None),
        "engine_host_ms_per_step": round(statistics.mean(host) * 1e3, 3) if host else None,
        "engine_host_share": round(sum(host) / max(wall, 1e-9), 4),
        "wall_s": round(wall, 3),
        "total_tokens_per_s": round((pre_tokens + dec_tokens) / wall, 1),
        "output_tokens_per_s": round(args.num_prompts * args.output_len / wall, 1),
        "prefill": {"steps": len(pre), "tokens": pre_tokens, "time_s": round(pre_time, 3),
                    "tokens_per_s": round(pre_tokens / max(pre_time, 1e-9), 1),
                    "tflops": round(pre_flops / max(pre_time, 1e-9) / 1e12, 1),
                    "ceiling_tflops": tp * BF16_TFLOPS},
        "decode": {"steps": len(dec), "tokens": dec_tokens, "time_s": round(dec_time, 3),
                   "tokens_per_s": round(dec_tokens / max(dec_time, 1e-9), 1),
                   "hbm_gbps": round(dec_bytes / max(dec_time, 1e-9) / 1e9, 1),
                   "median_full_batch_step_ms": round(med * 1e3, 3),
                   "floor_full_batch_step_ms": round(med_bytes / (tp * HBM_TBPS * 1e12) * 1e3,
                                                     3),
                   "ceiling_gbps": tp * HBM_TBPS * 1000},
    }
    print(json.dumps(result, indent=2))
    llm.shutdown()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
